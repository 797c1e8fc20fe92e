"""Reading one checkpoint directory: manifest, verification, and the Lightning dict; DCP's own
reader (resharding) with ``.metadata`` through the restricted unpickler."""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.format.manifest import Manifest, data_store
from lightning_preempt.format.names import DCP_METADATA_NAME, state_file
from lightning_preempt.format.pickles.unpickle import (
    MAX_METADATA_BYTES,
    apply_map_location,
    dcp_metadata,
    load_state_bytes,
)
from lightning_preempt.format.skeleton import merge_checkpoint, tensor_refs
from lightning_preempt.read.seal import sealed
from lightning_preempt.read.tensors import read_tensors, read_verified_bytes, tensor_items
from lightning_preempt.read.verify import (
    CORRUPT_HINT,
    Fallback,
    check_files,
    missing_file,
    read_manifest,
    verify_checkpoint,
)
from lightning_preempt.storage.store import Store

log = logging.getLogger(__name__)
T = TypeVar("T")

#: When no candidate checkpoint verifies (the resolver's choice and the load's fall-back).
NONE_VERIFIES_HINT = ("Inspect them with `lightning-preempt ls --verify DIR`; delete the damaged ones (or pass "
                      "ckpt_path explicitly) and restart.")  # fmt: skip


def load_skeleton(
    store: Store,
    manifest: Manifest,
    rank: int,
    *,
    verify: bool = False,
    trusted: bool = False,
    map_location: Any = None,
) -> Any:
    """The non-tensor state saved by ``rank`` (rank 0's when this rank did not exist then).
    ``verify``: size and CRC32C checked in the same read. Unpickled with the allow-list
    unless ``trusted`` (format/pickles/unpickle.py)."""
    name = state_file(rank)
    if name not in manifest.files:
        name = state_file(0)
    data = read_verified_bytes(data_store(store, manifest), name, manifest.files.get(name), verify=verify)
    # Storage is shared: a CRC proves integrity, not who wrote it. No code runs from it
    # unless the user opted in (docs/security.md).
    return load_state_bytes(data, path=store.url, trusted=trusted, map_location=map_location)


#: A template for a tensor of the checkpoint that the caller gave none for: ``(flat key, global
#: shape, dtype)`` -> an empty tensor or DTensor to load it into, or ``None`` to leave it out.
TemplateFor = Callable[[str, torch.Size, torch.dtype], Any]


def load_sharded_checkpoint(store: Store, templates: dict[str, Any], *, rank: int, verify: bool = True,
                            process_group: Any = None, trusted: bool = False,
                            verify_group: pdist.ProcessGroup | None = None,
                            template_for: TemplateFor | None = None) -> dict[str, Any]:  # fmt: skip
    """Load into ``templates`` (flat ``{key: tensor | DTensor}`` of the *current* model and
    optimizers, as :func:`split_checkpoint` makes them) in place, resharding, and return the
    Lightning checkpoint dict around them. Collective over ``process_group``. ``verify_group``:
    a gloo group of the same ranks; each rank then CRC-checks only its share of the files and
    the ranks agree on the outcome before loading. ``template_for``: templates for the
    checkpoint's tensors that ``templates`` lacks, made from its ``.metadata`` (shape, dtype)."""
    manifest = read_manifest(store)
    # Ranks may differ (rank 0 verified while choosing): all take part if any wants it.
    if any(pdist.all_gather_objects(verify, verify_group)):
        verify_shared(store, manifest, verify_group)
    if not verify:
        check_files(data_store(store, manifest), manifest)
    skeleton = load_skeleton(store, manifest, rank, trusted=trusted)
    refs = _checked(tensor_refs, skeleton, store=store)
    if template_for is not None:
        templates = {**templates, **_made_templates(store, manifest, refs, templates, template_for)}
    missing = set(templates) - set(refs)
    if missing:
        raise CorruptCheckpointError(
            f"the model has {len(missing)} tensors that the checkpoint lacks (e.g. {sorted(missing)[0]!r})",
            path=store.url,
            hint="Resume with the model and optimizers that wrote this checkpoint.",
        )
    load_tensors_into(data_store(store, manifest), templates, process_group=process_group, manifest=manifest)
    # refs the model did not ask for (e.g. dropped parameters) resolve to None
    result = _checked(
        merge_checkpoint, skeleton, collections.defaultdict[str, Any](lambda: None, templates), store=store
    )
    assert isinstance(result, dict)
    return result


def _made_templates(store: Store, manifest: Manifest, refs: list[str], templates: dict[str, Any],
                    template_for: TemplateFor) -> dict[str, Any]:  # fmt: skip
    """``template_for`` of each of ``refs`` that ``templates`` lacks, with its shape and dtype from
    the checkpoint's ``.metadata`` (through the restricted unpickler, checked as DCP's reader does)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    described = read_checked_metadata(data_store(store, manifest), manifest).state_dict_metadata
    made: dict[str, Any] = {}
    for key in refs:
        meta = described.get(key)
        if key not in templates and isinstance(meta, TensorStorageMetadata):
            template = template_for(key, meta.size, meta.properties.dtype)
            if template is not None:
                made[key] = template
    return made


def _checked(fn: Callable[..., T], *args: Any, store: Store) -> T:
    """``fn(*args)`` of format/skeleton.py; its ValueError (a list of keys that is not one,
    placeholders and keys that do not pair up) is a damaged state."""
    try:
        return fn(*args)
    except ValueError as err:
        raise CorruptCheckpointError(str(err), path=store.url, hint=CORRUPT_HINT) from None


def verify_shared(store: Store, manifest: Manifest, group: pdist.ProcessGroup | None) -> None:
    """Check every file's size and CRC32C, each file on one rank of ``group`` (the ``share``
    of :func:`verify_checkpoint`; without a group, every file here); every rank raises the
    first error any rank found. Collective over ``group``."""
    share = (pdist.rank(group), pdist.world_size(group)) if group is not None else (0, 1)
    agree.agree(lambda: verify_checkpoint(store, manifest, share=share), group)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a checkpoint is unpickled and read (or, in
    save/saver.py, while training waits for a save): tens of thousands of new objects
    trigger full collections, measured 0.04 s -> 0.2 s for one ``.metadata`` of 4000 tensors."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@gc_paused()
def load_full_checkpoint(
    store: Store,
    *,
    rank: int = 0,
    verify: bool = True,
    trusted: bool = False,
    map_location: Any = None,
    into: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The complete Lightning checkpoint dict, full tensors on CPU or where ``map_location``
    (as ``torch.load`` takes it) sends them. Every file this rank reads is checked against
    the manifest's size and CRC32C in the same pass (read/tensors.py); any mismatch raises
    :class:`CorruptCheckpointError` before anything is returned.

    ``into``: tensors by reference key (``"state_dict/net.weight"``: the model's own
    parameters) to read a *sealed* tier-0 copy straight into (read/tensors.py
    ``read_tensors``); the dict then holds those tensors. Ignored for anything the load must
    CRC-check first, and with a ``map_location``."""
    manifest = read_manifest(store)
    is_sealed = store.is_local and sealed(data_store(store, manifest).path(), manifest)
    if verify and is_sealed:
        verify = False  # verified on this node since it last changed (read/seal.py); sizes still checked
    # The caller's tensors are written while the files are read: only where no CRC32C verdict
    # comes after the read (a sealed copy; its sizes are checked before). A record that still
    # fails to parse raises with some written: the fall-back's load or the failed resume follows.
    into = into if is_sealed and map_location is None else None
    if not verify:
        check_files(data_store(store, manifest), manifest)
    skeleton = load_skeleton(store, manifest, rank, verify=verify, trusted=trusted, map_location=map_location)
    keys = set(_checked(tensor_refs, skeleton, store=store))
    tensors: dict[str, Any] = {}
    if keys:
        tensors = _load_all_tensors_verified(store, manifest, verify=verify, into=into)
        tensors = apply_map_location(tensors, map_location)
    missing = keys - set(tensors)
    if missing:
        raise CorruptCheckpointError(
            f"{len(missing)} tensors referenced by the state are not in the shards (e.g. {sorted(missing)[0]!r})",
            path=store.url,
            hint=CORRUPT_HINT,
        )
    result = _checked(merge_checkpoint, skeleton, tensors, store=store)
    assert isinstance(result, dict)
    return result


def _load_all_tensors_verified(
    store: Store, manifest: Manifest, *, verify: bool, into: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Every tensor of the shards, each shard file read once (CRC32C on the way)."""
    files = data_store(store, manifest)
    data = read_verified_bytes(files, DCP_METADATA_NAME, manifest.files.get(DCP_METADATA_NAME), verify=verify)
    items = tensor_items(dcp_metadata(data, path=store.url, manifest=manifest))
    if items is None:  # not a layout the one-pass reader knows: DCP's reader, verified first
        if verify:
            verify_checkpoint(store, manifest)
        return load_all_tensors(files, manifest=manifest)
    return read_tensors(files, items, manifest.files, verify=verify, into=into)


def load_agreed(load: Callable[[str, bool], dict[str, Any]], target: str, verified: bool, fallback: Fallback | None,
                group: pdist.ProcessGroup | None) -> tuple[dict[str, Any], str]:  # fmt: skip
    """``load(target, verified)`` with a fall-back all ranks agree on; returns the
    checkpoint and the path it was loaded from.

    The load checks every byte it reads (one pass); a :class:`CorruptCheckpointError` on
    any rank makes every rank drop its result and move on to ``fallback``'s next choice
    (rank 0's, broadcast), so no two ranks resume from different steps. Collective over
    ``group`` when both it and ``fallback`` are given (a gloo group idle during the load:
    the writer's); without a fallback the error is raised where it was found.
    """
    excluded: list[str] = []
    while True:
        result: dict[str, Any] | None = None
        error: CorruptCheckpointError | None = None
        try:
            result = load(target, verified)
        except CorruptCheckpointError as err:
            error = err
        # Only a load that can fall back agrees (every rank loads then: the resume pointer,
        # a directory of checkpoints); a plain path may be loaded by one rank alone.
        agreeing = group is not None and fallback is not None
        failed = pdist.all_gather_objects(error is not None, group) if agreeing else [error is not None]
        if not any(failed):
            assert result is not None
            return result, target
        result = None
        damaged = [r for r, f in enumerate(failed) if f]
        reason = str(error).splitlines()[0] if error is not None else f"rank(s) {damaged} found it damaged"
        if fallback is None:
            raise error or CorruptCheckpointError(reason, path=target, hint=CORRUPT_HINT)
        excluded.append(target)
        log.warning("lightning_preempt: %s failed its check while loading (%s); trying an older one", target, reason)
        nxt = fallback(excluded)
        nxt = pdist.broadcast_object(nxt, group) if agreeing else nxt
        if nxt is None:
            raise CorruptCheckpointError(f"no older checkpoint verifies either (tried {excluded})", path=target,
                                         hint=NONE_VERIFIES_HINT)  # fmt: skip
        target, verified = nxt, False


def load_plain_file(store: Store, *, map_location: Any = None, trusted: bool = False) -> dict[str, Any]:
    """A plain ``torch.save`` checkpoint file (Lightning's ``.ckpt``), read as Lightning's own
    plugin reads it but through our storage options (credentials). Unless ``trusted`` only
    ``weights_only`` types are unpickled (docs/security.md). A symlink the caller named is
    followed (``ModelCheckpoint(save_last="link")`` makes them)."""
    if store.is_local and os.path.islink(store.path()):
        store = Store(os.path.realpath(store.path()))
    with store.open_read("") as f:
        return torch.load(f, map_location=map_location or "cpu", weights_only=not trusted)  # type: ignore[no-any-return]


# ---- DCP's reader (resharding, and layouts the one-pass reader does not know) ------------
def read_checked_metadata(store: Store, manifest: Manifest | None) -> Any:
    """DCP's ``Metadata`` of the checkpoint whose files are in ``store``: read (at most its
    listed size), through the restricted unpickler, checked to name only tensors in byte
    ranges of the manifest's shard files (format/pickles/unpickle.py ``dcp_metadata``)."""
    entry = manifest.files.get(DCP_METADATA_NAME) if manifest is not None else None
    try:
        data = store.read_bytes(DCP_METADATA_NAME, entry.size if entry is not None else MAX_METADATA_BYTES)
    except FileNotFoundError as err:
        raise missing_file(DCP_METADATA_NAME, store) from err
    return dcp_metadata(data, path=store.url, manifest=manifest)


class _CheckedReader(_compat.FsspecReader):
    """DCP's reader for the shards of a checkpoint directory, with ``.metadata`` read through
    ``dcp_metadata`` (at most its listed size): a restricted unpickler and a check that it
    names only tensors in our shard files (``manifest``: the files it may refer to)."""

    def __init__(self, store: Store, manifest: Manifest | None) -> None:
        super().__init__(store.url, **store.storage_options)
        # the Store's own filesystem (its options: e.g. plain gcsfs against an emulator)
        self.fs.fs = store.dcp_filesystem()  # type: ignore[attr-defined]
        self._store = store
        self._manifest = manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_checked_metadata(self._store, self._manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata  # type: ignore[no-any-return]


def load_all_tensors(store: Store, *, manifest: Manifest | None = None) -> dict[str, Any]:
    """Every tensor of the shards, unsharded, on CPU, in this process alone (no template:
    the empty-state-dict planner, as DCP's ``dcp_to_torch_save`` does)."""
    tensors: dict[str, Any] = {}
    _compat.dcp_load_state_dict(
        tensors, storage_reader=_CheckedReader(store, manifest), planner=_compat.EmptyStateDictLoadPlanner(), no_dist=True
    )
    return tensors


def load_tensors_into(
    store: Store, tensors: dict[str, Any], *, process_group: Any = None, manifest: Manifest | None = None
) -> None:
    """Fill ``tensors`` (plain or ``DTensor``) in place from the shards, resharding as DCP
    does. Collective over ``process_group`` when torch.distributed is initialised."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        _compat.quiet_single_process_warning()
    dcp.load(tensors, storage_reader=_CheckedReader(store, manifest), process_group=process_group, no_dist=not distributed)

