"""Loading what a path means: one checkpoint, a directory of them (the newest valid one,
moving on after damage), a plain ``torch.save`` file, or an alias the engine set
(:meth:`Loader.alias`); verified while loading, with a fall-back all ranks agree on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning_preempt.catalog.newest import Fallback, fallback, newest_valid
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointNotFoundError, NotACheckpointError
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.read.load import (
    TemplateFor,
    load_agreed,
    load_full_checkpoint,
    load_plain_file,
    load_sharded_checkpoint,
)
from lightning_preempt.read.verify import Verify
from lightning_preempt.storage.store import Store, kind_at

LOAD_HINT = (
    "Pass a checkpoint directory written by ShardedAsyncCheckpointIO (it contains manifest.json), "
    "a directory of them, or a Lightning .ckpt file."
)


class Loader:
    """Loads checkpoints for one process; ``trust_checkpoints``: full ``pickle`` (docs/security.md)."""

    def __init__(self, storage_options: dict[str, Any], *, verify_on_load: bool, trust_checkpoints: bool) -> None:
        self.storage_options = storage_options
        self.verify_on_load = verify_on_load
        self.trust_checkpoints = trust_checkpoints
        self._aliases: dict[str, str] = {}
        self._fallbacks: dict[str, Fallback] = {}
        self._into: dict[str, Callable[[], Mapping[str, Any]]] = {}
        #: The checkpoint the last :meth:`load` returned (after any fall-back).
        self.loaded_from: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fallbacks"] = {}  # closures over one fit's process groups
        state["_into"] = {}  # and over its model
        return state

    def alias(
        self,
        path: str,
        target: str,
        *,
        fallback: Fallback | None = None,
        into: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        """Make a load of ``path`` load ``target``. ``fallback(excluded)``: the next checkpoint
        to try when the load finds ``target`` damaged (every rank calls it, rank 0's answer is
        taken), or ``None`` when none is left. ``into()``: the tensors (by reference key, e.g.
        the model's parameters) a sealed tier-0 copy is read straight into
        (read/load.py ``load_full_checkpoint``); asked for when the load starts."""
        self._aliases[str(path)] = target
        if fallback is not None:
            self._fallbacks[str(path)] = fallback
        if into is not None:
            self._into[str(path)] = into

    def resolve(self, path: Any) -> str | None:
        """The committed checkpoint ``path`` means (alias, checkpoint dir, or the newest valid
        in a directory of checkpoints), or ``None`` when it is none of ours."""
        return self._resolve(self._aliases.get(str(path), str(path)))

    def _resolve(self, url: str) -> str | None:
        store = Store(url, self.storage_options)
        if store.stat(MANIFEST_NAME) is not None:
            return url
        if kind_at(store) == "dir":
            # Manifests and sizes only: the load checks the CRC32C of every byte it reads and
            # falls back to the next one on damage.
            verify: Verify = "sizes" if self.verify_on_load else False
            info = newest_valid(url, self.storage_options, verify=verify)
            if info is not None:
                return info.path
        return None

    def fallback_for(self, path: Any) -> Fallback | None:
        """The fall-back a load of ``path`` moves on with after damage: the one given with its
        alias, or for a directory of checkpoints the next valid one in it; else ``None``."""
        retry = self._fallbacks.get(str(path))
        url = self._aliases.get(str(path), str(path))
        store = Store(url, self.storage_options)
        if retry is None and kind_at(store) == "dir" and store.stat(MANIFEST_NAME) is None:
            retry = fallback(url, self.storage_options, verify="sizes")
        return retry

    def not_found(self, url: str) -> NotACheckpointError:
        """The error for a path without a checkpoint; worded as Lightning's for a missing
        ``ckpt_path`` when nothing is there (scripts match on that text)."""
        if Store(url, self.storage_options).stat() is None:
            return CheckpointNotFoundError(f"Checkpoint file not found: {url}", path=url, hint=LOAD_HINT)
        return NotACheckpointError("no committed checkpoint found", path=url, hint=LOAD_HINT)

    def load(
        self, path: Any, *, map_location: Any = None, trusted: bool, group: pdist.ProcessGroup | None
    ) -> dict[str, Any]:
        """The checkpoint dict at ``path`` (tensors on CPU, or where ``map_location`` sends
        them). ``group``: a gloo group idle during the load; every rank falling back agrees on it."""
        url = self._aliases.get(str(path), str(path))
        store = Store(url, self.storage_options)
        # A plain Lightning file; on an object store also one that replaced a checkpoint
        # directory whose objects are still being deleted (its manifest went first).
        if store.stat(MANIFEST_NAME) is None and kind_at(store) == "file":
            return load_plain_file(store, map_location=map_location, trusted=trusted)
        into = self._into.get(str(path))

        def load(at: str, at_verified: bool) -> dict[str, Any]:
            return load_full_checkpoint(Store(at, self.storage_options), rank=pdist.rank(),
                                        verify=self.verify_on_load and not at_verified, trusted=trusted,
                                        map_location=map_location, into=into() if into is not None else None)  # fmt: skip

        return self._load_agreed(path, load, group)

    def load_sharded(
        self, path: Any, templates: dict[str, Any], *, process_group: Any, verify_group: pdist.ProcessGroup | None,
        template_for: TemplateFor | None = None,
    ) -> dict[str, Any]:
        """Load into sharded ``templates`` in place (collective; read/load.py
        ``load_sharded_checkpoint``, with its ``template_for``); each rank CRC-checks a share of
        the files, and damage moves every rank to the same older checkpoint, as :meth:`load` does."""

        def load(at: str, at_verified: bool) -> dict[str, Any]:
            # Every file is checked before any tensor is read: a damaged one leaves the
            # templates as they were for the next try.
            return load_sharded_checkpoint(Store(at, self.storage_options), templates, rank=pdist.rank(),
                                           verify=self.verify_on_load and not at_verified,
                                           process_group=process_group, trusted=self.trust_checkpoints,
                                           verify_group=verify_group, template_for=template_for)  # fmt: skip

        return self._load_agreed(path, load, verify_group)

    def _load_agreed(self, path: Any, load: Callable[[str, bool], dict[str, Any]],
                     group: pdist.ProcessGroup | None) -> dict[str, Any]:  # fmt: skip
        """``load(checkpoint, verified)`` of the checkpoint ``path`` means, falling back after damage
        to the checkpoint every rank of ``group`` agrees on; :attr:`loaded_from` says which."""
        url = self._aliases.get(str(path), str(path))
        target = self._resolve(url)
        if target is None:
            raise self.not_found(url)
        checkpoint, self.loaded_from = load_agreed(load, target, False, self.fallback_for(path), group)
        return checkpoint
