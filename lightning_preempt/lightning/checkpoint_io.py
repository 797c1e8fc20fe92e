"""The Lightning ``CheckpointIO`` plugin: an adapter over the save pipeline (save/saver.py)
and the loader (catalog/loader.py). It only maps Lightning's three calls onto them and
decides which saves are asynchronous; the mechanism lives below (docs/design.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_preempt.catalog.loader import Loader
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine import deprecated as deprecated_names
from lightning_preempt.engine.config import CheckpointIOConfig, Tuning, check_local_dirpath
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.lightning import _compat
from lightning_preempt.read.load import TemplateFor
from lightning_preempt.save.history import SaveRecord
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.staging.overlap import resolve as resolve_overlap
from lightning_preempt.tiers.two_tier import TwoTier


class ShardedAsyncCheckpointIO(CheckpointIO):
    """Asynchronous, sharded, verifiable checkpoints for Lightning.

    ``save_checkpoint`` returns once every tensor is copied into reusable host buffers
    and the path exists; a background thread writes the shards through DCP to any fsspec
    URL and commits the checkpoint by writing its manifest last. One save writes at a
    time: a new save waits until the previous one's tensors are written, so it stages while
    that one commits, at any number of ranks (two tiers: it waits for the commit); commits
    stay in step order. Saving to a path that holds a
    committed checkpoint replaces it without ever tearing it (docs/dropin.md).
    ``load_checkpoint`` verifies sizes and CRC32C before returning the usual Lightning
    checkpoint dict; it also reads plain Lightning ``.ckpt`` files.

    Outside ``fit`` there is no step to overlap with. After :meth:`teardown` (the end of
    ``fit``), and for a ``Trainer`` that has not started a training epoch (its
    ``save_checkpoint`` before ``fit``), saves are synchronous plain Lightning files
    (``Model.load_from_checkpoint`` reads them). After :meth:`teardown` removes run at once
    too, until the next ``fit`` sets the plugin up again (:meth:`enable_collective_saves`);
    before the first save they do as well. Neither starts a thread. The plugin pickles and
    deep-copies (``ddp_spawn``): threads, buffers and pending saves are not copied.

    ``fabric.save`` with this plugin saves on every rank (:func:`wrap_save`).

    Its options (``storage_options`` for the plugin alone, ``host_memory_budget``,
    ``verify_on_load``, ``trust_checkpoints``) and the :class:`~lightning_preempt.Tuning` it
    reads are written once, in :class:`~lightning_preempt.engine.config.CheckpointIOConfig`
    (docs/options.md), and validated here.
    """

    _warned_alone = False  # warn_if_alone: once per plugin

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        *,
        host_memory_budget: int | float | None = None,
        verify_on_load: bool = True,
        trust_checkpoints: bool = False,
        tuning: Tuning | None = None,
        **deprecated: Any,
    ) -> None:
        super().__init__()
        tuning, local_dirpath = deprecated_names.plugin(tuning, deprecated_names.plugin_names(**deprecated))
        self.config = config = CheckpointIOConfig.make(
            tuning, storage_options=storage_options, host_memory_budget=host_memory_budget,
            verify_on_load=verify_on_load, trust_checkpoints=trust_checkpoints,
        )  # fmt: skip
        self.storage_options = config.storage_options
        pin = config.pinned_memory_budget
        self.saver = Saver(config.storage_options, pin_memory=False if pin == 0 else None, thread_count=config.thread_count,
                           host_memory_budget=config.host_memory_budget, pinned_memory_budget=pin or None,
                           overlap_staging=resolve_overlap(config.overlap_staging))  # fmt: skip
        if local_dirpath is not None:
            self.saver.use_local_tier(str(check_local_dirpath(local_dirpath)), retries=config.retries, backoff_s=config.backoff_s)
        self.loader = Loader(config.storage_options, verify_on_load=config.verify_on_load,
                             trust_checkpoints=config.trust_checkpoints)  # fmt: skip
        _compat.route_fabric_saves(wrap_save)  # fabric.save reaches our save_checkpoint on every rank
        _compat.at_fit_setup(warn_if_alone)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A spawned worker (ddp_spawn) unpickles the plugin in a fresh interpreter: route there too.
        self.__dict__.update(state)
        _compat.route_fabric_saves(wrap_save)
        _compat.at_fit_setup(warn_if_alone)

    # ---- CheckpointIO ------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` and return; the background writer flushes and commits it.

        ``path`` exists when this returns. A committed checkpoint already at ``path`` is
        replaced once the new one is committed (never torn). Outside ``fit`` (after
        :meth:`teardown`, or before a training epoch started) the save is synchronous and
        writes a plain Lightning file. ``storage_options``: fsspec options for this save, or
        the :class:`~lightning_preempt.save.order.SaveOrder` a front-end passes through
        Lightning's strategy (docs/design.md "A save, hop by hop").

        Raises:
            CheckpointWriteError: the previous save failed (raised once).
        """
        order = self.order(path, storage_options)
        if order.fabric:
            # fabric.save, on every rank (:func:`wrap_save`): asynchronous and sharded. Without a
            # group from Preemption the first save makes the writer's (collective: every rank saves).
            if self.saver.group is None and pdist.world_size() > 1:
                self.saver.enable_collective(pdist.new_gloo_group())
                self.saver.use_stage_group(pdist.new_gloo_group())  # the next save stages while one commits
            elif self.saver.closed:  # after Fabric's teardown: saves stay asynchronous and sharded
                self.saver.enable_collective(self.saver.group)
            self.saver.save(checkpoint, order)
            return
        outside_fit = self.saver.closed or not _training_started(checkpoint)
        if outside_fit and not _holds_dtensors(checkpoint):
            self.saver.save_plain(checkpoint, order.url, dict(order.options))
        else:
            # (outside fit with DTensors, i.e. ModelParallelStrategy after fit: no single file
            # can hold the shards; the directory is written synchronously)
            self.saver.save(checkpoint, order, wait=outside_fit)

    def order(self, path: Any, storage_options: Any) -> SaveOrder:
        """The save to ``path``: the order given as ``storage_options``, else a save the framework
        or a user asked for with those fsspec options; the plugin's options under either's."""
        if isinstance(storage_options, SaveOrder):
            return dataclasses.replace(storage_options, url=str(path),
                                       options={**self.storage_options, **storage_options.options})  # fmt: skip
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(
                "lightning_preempt: storage_options must be a dict of fsspec options or None, got "
                f"{type(storage_options).__name__}\nHINT: e.g. trainer.save_checkpoint(path, "
                "storage_options={'endpoint_url': 'http://127.0.0.1:9000'})"
            )
        return SaveOrder(str(path), options={**self.storage_options, **(storage_options or {})})

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a committed checkpoint as Lightning's checkpoint dict (tensors on CPU, or
        where ``map_location`` sends them).

        ``path`` may be a checkpoint directory, a directory of checkpoints (the newest
        valid one is taken), or a plain Lightning ``.ckpt`` file. ``weights_only``: ``True``
        loads only allow-listed types even with ``trust_checkpoints``; ``False`` trusts
        this one checkpoint (full unpickling); ``None``: ``trust_checkpoints`` decides.
        """
        trusted = self.config.trust_checkpoints if weights_only is None else not weights_only
        self.saver.wait()
        return self.loader.load(path, map_location=map_location, trusted=trusted, group=self.saver.group)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete whatever is at ``path`` (our checkpoint directory, a plain ``.ckpt`` file,
        a symlink) after every pending write: a delete never overtakes a save. Failures are
        logged with the path, never raised into training. Synchronous after :meth:`teardown`
        and before the first save."""
        self.saver.remove(str(path))

    @override
    def teardown(self) -> None:
        """Wait for pending saves, deletes and drains, then stop the threads. From now on
        saves and removes are synchronous (see the class docstring)."""
        self.saver.close()

    # ---- used by the engine and the strategy hooks ---------------------------------------
    def use_storage_options(self, options: dict[str, Any]) -> None:
        """The callback's ``storage_options`` (it owns them), over any the plugin was given."""
        if options:
            self.storage_options = {**self.storage_options, **options}
            self.saver.storage_options = self.loader.storage_options = self.storage_options
            if self.saver.tiers is not None:
                self.saver.tiers.remote_options = self.storage_options

    def enable_collective_saves(self, group: pdist.ProcessGroup | None) -> None:
        """Every rank calls ``save_checkpoint`` from now on; the writer syncs on ``group`` (a
        gloo group reserved for it). Called at the start of every ``fit``; it also re-enables
        asynchronous saves after :meth:`teardown`."""
        self.saver.enable_collective(group)

    def alias(self, path: str, target: str, *, fallback: Any = None, into: Any = None) -> None:
        """Make ``load_checkpoint(path)`` load ``target`` (catalog/loader.py ``Loader.alias``)."""
        self.loader.alias(path, target, fallback=fallback, into=into)

    def resolve(self, path: Any) -> str | None:
        """The committed checkpoint ``path`` means, or ``None`` when it is none of ours."""
        return self.loader.resolve(path)

    def load_sharded(self, path: Any, templates: dict[str, Any], process_group: Any = None,
                     template_for: TemplateFor | None = None) -> dict[str, Any]:  # fmt: skip
        """Load into sharded ``templates`` in place (collective; catalog/loader.py)."""
        self.saver.wait()
        return self.loader.load_sharded(path, templates, process_group=process_group, verify_group=self.saver.group,
                                        template_for=template_for)  # fmt: skip

    def prepare_staging(self, checkpoint_like: dict[str, Any], *, background: bool = True) -> Future[int]:
        """Allocate this rank's staging buffers ahead of the first save (save/saver.py)."""
        return self.saver.prepare_staging(checkpoint_like, background=background)

    def set_tiers(self, remote_root: str | None, *, keep_last_n: int | None = None,
                  group: pdist.ProcessGroup | None = None) -> None:  # fmt: skip
        """Two tiers: the remote root that maps to ``local_dirpath``, per-tier retention, and a
        gloo group for the drain thread alone (collective when given)."""
        if self.saver.tiers is not None:
            self.saver.tiers.configure(remote_root, keep_last_n, group)

    def wait(self) -> Manifest | None:
        """Block until every pending save is committed; re-raise a writer error once."""
        return self.saver.wait()

    def wait_drained(self, timeout_s: float | None = None) -> bool:
        """Two tiers: wait for local commits, then for drains (at most ``timeout_s``)."""
        return self.saver.wait_drained(timeout_s)

    def submit(self, job: Any) -> Future[Any]:
        """Run ``job`` after every pending save and delete (save/saver.py)."""
        return self.saver.submit(job)

    @property
    def tiers(self) -> TwoTier | None:
        return self.saver.tiers

    @property
    def history(self) -> list[SaveRecord]:
        """Timings of the newest saves (save/saver.py ``SaveRecord``)."""
        return self.saver.history

    @property
    def loaded_from(self) -> str | None:
        """The checkpoint the last ``load_checkpoint`` returned (after any fall-back)."""
        return self.loader.loaded_from

    @property
    def staging_allocated_bytes(self) -> int:
        """Host staging memory allocated so far (constant in steady state)."""
        return self.saver.stager.allocated_bytes

    @property
    def staging_last_bytes(self) -> int:
        """Bytes this rank copied into staging buffers in its last save (its share under DDP)."""
        return self.saver.stager.last_staged_bytes


# The callbacks that act on a preemption: lightning/callback.py adds PreemptionCallback (it imports
# this module, so this one cannot import it back).
PREEMPTION_GUARDS: list[type] = []

ALONE_WARNING = (
    "lightning_preempt: ShardedAsyncCheckpointIO is in this Trainer without PreemptionCallback. Its saves "
    "(ModelCheckpoint, trainer.save_checkpoint) are asynchronous and verified, but nothing acts on a preemption: "
    "on SIGTERM no snapshot is taken, the steps since the last save are lost, the process does not exit 143 for "
    "a requeue (a scheduler may take the job as finished), and the next run does not resume by itself.\n"
    "HINT: add the callback: Trainer(plugins=[ShardedAsyncCheckpointIO(...)], "
    "callbacks=[PreemptionCallback(dirpath=...)]) (docs/guide.md); as a drop-in for ModelCheckpoint's saves alone "
    "(docs/dropin.md) this warning can be filtered."
)


def warn_if_alone(trainer: Any) -> None:
    """At ``fit``'s set-up (:func:`_compat.at_fit_setup`): warn once per plugin when the
    Trainer's ``CheckpointIO`` is ours but no :class:`PreemptionCallback` is among its callbacks."""
    io = getattr(trainer.strategy, "_checkpoint_io", None)
    while io is not None and not isinstance(io, ShardedAsyncCheckpointIO):
        io = getattr(io, "checkpoint_io", None)  # inside a _WrappingCheckpointIO (AsyncCheckpointIO)
    if io is None or getattr(io, "_warned_alone", False):
        return
    if not any(isinstance(callback, tuple(PREEMPTION_GUARDS)) for callback in trainer.callbacks):
        io._warned_alone = True
        rank_zero_warn(ALONE_WARNING, category=UserWarning)


def _training_started(checkpoint: dict[str, Any]) -> bool:
    """A training epoch has started in the ``Trainer`` that made ``checkpoint`` (its fit-loop
    progress; ``True`` for a dict that is not a Trainer checkpoint). ``False`` for
    ``Trainer.save_checkpoint`` before ``fit``, whose plugin no ``teardown`` will follow."""
    try:
        return int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["started"]) > 0
    except (KeyError, TypeError, ValueError):
        return True


def _holds_dtensors(obj: Any) -> bool:
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return isinstance(obj, DTensor) or any(_holds_dtensors(v) for v in items)


# ---- fabric.save through the plugin on every rank ----------------------------------------------
def fabric_order(io: ShardedAsyncCheckpointIO, path: Any, storage_options: Any, state: dict[str, Any]) -> SaveOrder:
    """The order of a ``fabric.save`` of ``state`` (the engine's, given as ``storage_options``, or
    a user's): Fabric's, the top-level keys that hold a module or an optimizer sharded."""
    keys = tuple(str(k) for k, v in state.items() if isinstance(v, (Module, Optimizer)))
    return dataclasses.replace(io.order(path, storage_options), fabric=True, sharded_keys=keys)


def wrap_save(original: Callable[..., None]) -> Callable[..., None]:
    """Fabric's base ``Strategy.save_checkpoint`` (single device, DDP, DP: the plugin on rank 0
    alone), routed to our plugin on every rank: the replicated tensors are split between the
    ranks (DCP), the keys that held a module or optimizer are sharded. Installed once per
    process by the plugin (``_compat.route_fabric_saves``)."""

    def save_checkpoint(
        self: Any, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        io = self.checkpoint_io
        if not isinstance(io, ShardedAsyncCheckpointIO):  # (a ``Mock()`` one in Lightning's own tests)
            original(self, path, state, storage_options, filter)
            return
        order = fabric_order(io, path, storage_options, state)
        converted = _compat.convert_fabric_state(self, state, filter or {})
        if pdist.world_size() > 1 or self.is_global_zero:
            # Through ``save_checkpoint``, the CheckpointIO contract (a subclass overriding it,
            # or a test mocking it, sees the save); the order says it is Fabric's.
            io.save_checkpoint(checkpoint=converted, path=path, storage_options=order)

    return save_checkpoint
