"""The Lightning ``CheckpointIO`` plugin: sharded, staged, asynchronous, committed saves."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_preempt.catalog.newest import newest_valid
from lightning_preempt.catalog.ownership import remove_checkpoint_dir
from lightning_preempt.catalog.verified import mark_verified
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine.config import check_plugin_options, local_dirpath_from_env
from lightning_preempt.errors import CheckpointNotFoundError, CheckpointWriteError, NotACheckpointError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.format.shares import own_share, replica_fingerprint
from lightning_preempt.format.skeleton import DEFAULT_SHARDED_KEYS
from lightning_preempt.format.skeleton import split_checkpoint as _split
from lightning_preempt.read.load import Fallback, load_agreed, load_full_checkpoint, load_sharded_checkpoint
from lightning_preempt.save.commit import SaveRequest, write_checkpoint
from lightning_preempt.save.jobs import JobQueue
from lightning_preempt.save.layout import ensure_exists, remove_local, write_file_atomic
from lightning_preempt.save.staging import HostStager
from lightning_preempt.save.tiers import TwoTier
from lightning_preempt.storage.store import Store

log = logging.getLogger(__name__)

_LOAD_HINT = (
    "Pass a checkpoint directory written by ShardedAsyncCheckpointIO (it contains manifest.json), "
    "a directory of them, or a Lightning .ckpt file."
)


def _training_started(checkpoint: dict[str, Any]) -> bool:
    """A training epoch has started in the ``Trainer`` that made ``checkpoint`` (its fit-loop
    progress; ``True`` for a dict that is not a Trainer checkpoint). ``False`` for
    ``Trainer.save_checkpoint`` before ``fit``, whose plugin no ``teardown`` will follow."""
    try:
        return int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["started"]) > 0
    except (KeyError, TypeError, ValueError):
        return True


def _holds_dtensors(obj: Any) -> bool:
    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, dict):
        return any(_holds_dtensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_dtensors(v) for v in obj)
    return False


#: Save records kept in :attr:`ShardedAsyncCheckpointIO.history` (the newest ones).
HISTORY_KEPT = 64


class SaveRecord:
    """Timings of one save, filled in as it progresses (seconds, bytes)."""

    __slots__ = ("blocking_s", "bytes", "committed_s", "error", "path", "started", "step", "waited_s")

    def __init__(self, path: str, step: int, started: float) -> None:
        self.path = path
        self.step = step
        self.started = started
        self.waited_s = 0.0
        self.blocking_s = 0.0
        self.committed_s: float | None = None
        self.bytes = 0
        self.error: BaseException | None = None

    @property
    def throughput_bps(self) -> float | None:
        if not self.committed_s:
            return None
        return self.bytes / max(self.committed_s - self.blocking_s, 1e-9)


class ShardedAsyncCheckpointIO(CheckpointIO):
    """Asynchronous, sharded, verifiable checkpoints for Lightning.

    ``save_checkpoint`` returns once every tensor is copied into reusable host buffers
    and the path exists; a background thread writes the shards through DCP to any fsspec
    URL and commits the checkpoint by writing its manifest last. At most one save is in
    flight: a new save first waits for the previous one. Saving to a path that holds a
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

    Args:
        storage_options: fsspec options for every path (credentials, ``endpoint_url``…).
        pin_memory: pin staging buffers; default: when CUDA is available.
        thread_count: writer threads per rank (DCP serialisation is CPU-bound).
        verify_on_load: check every file's CRC32C before loading.
        sharded_keys: top-level checkpoint keys whose tensors go to DCP shards.
        local_dirpath: two-tier mode (docs/two-tier.md): a save to ``<remote_root>/<name>``
            commits to ``<local_dirpath>/<name>`` on fast node-local storage first, then a
            background drain uploads it to the remote URL (``storage_options`` apply there).
        drain_workers: files uploaded in parallel per rank by a drain.
        drain_retries: attempts per drain for transient errors (exponential backoff).
        drain_backoff_s: the first retry delay (doubles per attempt).
        trust_checkpoints: unpickle the non-tensor state of checkpoints with full
            ``pickle`` (``weights_only=False``), for states that keep arbitrary objects.
            Off by default: checkpoints are untrusted input and only the few types this
            package and Lightning write are loaded (docs/security.md). ``load_checkpoint``'s
            ``weights_only`` overrides it for one load.
    """

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        *,
        pin_memory: bool | None = None,
        thread_count: int = 1,
        verify_on_load: bool = True,
        sharded_keys: tuple[str, ...] = DEFAULT_SHARDED_KEYS,
        local_dirpath: str | None = None,
        drain_workers: int = 4,
        drain_retries: int = 4,
        drain_backoff_s: float = 1.0,
        trust_checkpoints: bool = False,
    ) -> None:
        super().__init__()
        check_plugin_options(
            storage_options=storage_options, pin_memory=pin_memory, thread_count=thread_count,
            verify_on_load=verify_on_load, sharded_keys=sharded_keys, drain_workers=drain_workers,
            drain_retries=drain_retries, drain_backoff_s=drain_backoff_s, trust_checkpoints=trust_checkpoints,
        )  # fmt: skip
        self.trust_checkpoints = trust_checkpoints
        self.storage_options = dict(storage_options or {})
        self.thread_count = thread_count
        self.verify_on_load = verify_on_load
        self.sharded_keys = tuple(sharded_keys)
        self._stager = HostStager(pin_memory)
        #: DDP: each rank stages and writes only its share of the replicated tensors
        #: (``format.own_share``) when every rank holds the same ones (checked per save).
        self.dedupe_replicas = True
        self._writer = JobQueue()
        self._pending: Future[Manifest] | None = None
        self._group: pdist.ProcessGroup | None = None
        self._group_rank = 0
        self._closed = False
        self._aliases: dict[str, str] = {}
        self._fallbacks: dict[str, Fallback] = {}
        #: The checkpoint the last ``load_checkpoint`` returned (after any fall-back).
        self.loaded_from: str | None = None
        self._verified: set[str] = set()
        self.history: list[SaveRecord] = []
        #: recorded in every manifest; retention never deletes another run's checkpoints
        self.run_id: str | None = None
        local = local_dirpath_from_env(local_dirpath)
        self._tier_args = (local, drain_workers, drain_retries, drain_backoff_s)
        self.tiers: TwoTier | None = self._make_tiers()

    def _make_tiers(self) -> TwoTier | None:
        local, workers, retries, backoff_s = self._tier_args
        if not local:
            return None
        return TwoTier(local, self.storage_options, max_workers=workers, retries=retries, backoff_s=backoff_s)

    # ---- pickling (ddp_spawn, deepcopy of a trainer) ------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Configuration only: a copy has no pending save, process group, thread or buffers
        (the writer and the stager drop theirs themselves)."""
        state = self.__dict__.copy()
        state.update(_pending=None, _group=None, _group_rank=0, history=[], tiers=None, _fallbacks={})
        tiers = self.tiers
        state["_tier_config"] = (tiers.remote_root, tiers.keep_last_n) if tiers is not None else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tier_config = state.pop("_tier_config", None)
        self.__dict__.update(state)
        self.tiers = self._make_tiers()
        if self.tiers is not None and tier_config is not None:
            # configure() is collective; the callback calls it again in setup()
            self.tiers.remote_root, self.tiers.keep_last_n = tier_config

    # ---- wiring used by the callback ---------------------------------------------------
    def enable_collective_saves(self, group: pdist.ProcessGroup | None) -> None:
        """Every rank calls ``save_checkpoint`` from now on; the writer syncs on ``group``.

        ``group`` must be a gloo group reserved for the writer thread. Called at the start
        of every ``fit`` (by :class:`PreemptionCallback`); it also re-enables asynchronous
        saves after :meth:`teardown`.
        """
        self._group = group
        self._group_rank = pdist.rank(group) if group is not None else 0
        self._closed = False

    def alias(
        self, path: str, target: str, *, verified: bool = False, fallback: Fallback | None = None
    ) -> None:
        """Make ``load_checkpoint(path)`` load ``target`` (the resume pointer).

        ``verified``: this process already checked ``target``'s CRC32C; loading skips it.
        ``fallback(excluded)``: the next checkpoint to try when the load finds ``target``
        corrupt (its CRC32C is checked while loading; every rank calls ``fallback`` and
        rank 0's answer is taken), or ``None`` when none is left. Choosing with
        ``newest_valid(..., verify="sizes")`` and passing this reads every byte once.
        """
        self._aliases[str(path)] = target
        if verified:
            self._verified.add(target)
        if fallback is not None:
            self._fallbacks[str(path)] = fallback

    @property
    def staging_allocated_bytes(self) -> int:
        """Host staging memory allocated so far (constant in steady state)."""
        return self._stager.allocated_bytes

    @property
    def staging_last_bytes(self) -> int:
        """Bytes this rank copied into staging buffers in its last save (its share under DDP)."""
        return self._stager.last_staged_bytes

    def prepare_staging(self, checkpoint_like: dict[str, Any], *, background: bool = True) -> Future[int]:
        """Allocate and touch this rank's staging buffers now, from the tensors'
        shapes alone, so the first (and the emergency) save only copies.

        ``checkpoint_like``: any dict shaped like the checkpoints to come, e.g.
        ``{"state_dict": module.state_dict(), "optimizer_states": [o.state_dict() for o in opts]}``
        (see :func:`lightning_preempt.prealloc.checkpoint_like`). Not collective; call it
        again when the state grows (optimizer state appears at the first step): buffers
        that fit are kept. The Future holds the bytes newly allocated.
        """
        tensors, _ = _split(checkpoint_like, self.sharded_keys)
        if self._dedupes():
            tensors = own_share(tensors, pdist.rank(self._group), pdist.world_size(self._group))
        return self._stager.prepare(tensors, background=background)

    def _dedupes(self) -> bool:
        return self.dedupe_replicas and self._group is not None and pdist.world_size(self._group) > 1

    def _my_share(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of the replicated tensors (collective saves under DDP).

        Ranks compare fingerprints first (one small gather on the writer's group, idle
        here: the previous save has finished): a tensor only some ranks hold would be
        lost if its owner lacked it, so any difference means every rank stages all.
        """
        if not self._dedupes():
            return tensors
        fingerprints = pdist.all_gather_objects(replica_fingerprint(tensors), self._group)
        if len(set(fingerprints)) != 1:
            log.warning("lightning_preempt: ranks hold different tensors; every rank stages all of them")
            return tensors
        return own_share(tensors, pdist.rank(self._group), len(fingerprints))

    @property
    def last_save(self) -> SaveRecord | None:
        return self.history[-1] if self.history else None

    def _options(self, storage_options: Any) -> dict[str, Any]:
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(
                "lightning_preempt: storage_options must be a dict of fsspec options or None, got "
                f"{type(storage_options).__name__}\nHINT: e.g. trainer.save_checkpoint(path, "
                "storage_options={'endpoint_url': 'http://127.0.0.1:9000'})"
            )
        return {**self.storage_options, **(storage_options or {})}

    # ---- CheckpointIO ------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage ``checkpoint`` and return; the background writer flushes and commits it.

        ``path`` exists when this returns. A committed checkpoint already at ``path`` is
        replaced once the new one is committed (never torn). Outside ``fit`` (after
        :meth:`teardown`, or before a training epoch started) the save is synchronous and
        writes a plain Lightning file.

        Raises:
            CheckpointWriteError: the previous save failed (raised once).
        """
        started = time.perf_counter()
        url = str(path)
        # Outside fit (after teardown, or before any training epoch: Trainer.save_checkpoint
        # on a Trainer that has not run fit) there is no step to overlap with.
        outside_fit = self._closed or not _training_started(checkpoint)
        if outside_fit and not _holds_dtensors(checkpoint):
            self._save_plain(checkpoint, url, self._options(storage_options))
            return
        # (closed with DTensors, i.e. ModelParallelStrategy after fit: no single file can hold
        # the shards; the directory is written synchronously below, through submit())
        record = SaveRecord(url, int(checkpoint.get("global_step", -1)), started)
        self._wait_pending()  # at most one save in flight: the stager's buffers are in use until commit
        record.waited_s = time.perf_counter() - started
        options = self._options(storage_options)
        store = Store(url, options)
        local_url = self.tiers.local_twin(url) if self.tiers is not None else None
        if self._group_rank == 0:
            # ModelCheckpoint looks for the path right after saving (-v1 versioning,
            # save_last="link"). Two tiers: the training thread touches only the local disk
            # (a remote outage must not stall a step).
            try:
                ensure_exists(store if local_url is None else Store(local_url))
            except Exception as err:
                # Never raise on rank 0 alone here: the other ranks would enter the writer's
                # collectives and wait for it until the group times out. The write job meets
                # the same failure and raises it on every rank (commit.py's agreement).
                log.warning("lightning_preempt: could not create %s yet (%s); the save reports it", url, err)
        tensors, skeleton = _split(checkpoint, self.sharded_keys)
        tensors = self._my_share(tensors)
        buffer = io.BytesIO()
        torch.save(skeleton, buffer)  # freezes the non-tensor state now
        staged = self._stager.stage(tensors)
        record.bytes = self._stager.last_staged_bytes + buffer.tell()
        record.blocking_s = time.perf_counter() - started
        request = SaveRequest(
            url=url,
            tensors=staged,
            skeleton=buffer.getvalue(),
            step=record.step,
            epoch=int(checkpoint.get("epoch", -1)),
            storage_options=options,
            stats={"blocking_s": record.blocking_s},
            run_id=self.run_id,
        )
        self.history.append(record)
        del self.history[:-HISTORY_KEPT]  # a long run saves thousands of times
        if local_url is not None and self.tiers is not None:
            tiers = self.tiers

            def write_to(tier_url: str, tier_options: dict[str, Any]) -> Manifest:
                tier_request = dataclasses.replace(request, url=tier_url, storage_options=tier_options)
                record.error = None  # a local failure followed by a remote fallback that works
                return self._write(tier_request, record, Store(tier_url, tier_options))

            self._pending = self.submit(lambda: tiers.save(write_to, url, local_url, record.step))
        else:
            self._pending = self.submit(lambda: self._write(request, record, store))
        if outside_fit:
            self._wait_pending()  # synchronous outside fit: raise its error now

    def _write(self, request: SaveRequest, record: SaveRecord, store: Store) -> Manifest:
        try:
            # write_checkpoint clears an uncommitted leftover at the path (never mixing old
            # and new files) and replaces a committed checkpoint there (layout.py).
            manifest = write_checkpoint(request, group=self._group, thread_count=self.thread_count)
        except BaseException as err:
            record.error = err
            raise
        record.committed_s = time.perf_counter() - record.started
        if pdist.rank(self._group) != 0:
            return manifest
        mark_verified(request.url, manifest)  # CRC32C computed from the bytes written: retention need not re-read
        log.info(
            "lightning_preempt: committed %s (step %d): blocked %.3fs, committed after %.3fs, %.1f MB at %.0f MB/s",
            request.url,
            request.step,
            record.blocking_s,
            record.committed_s,
            record.bytes / 1e6,
            (record.throughput_bps or 0.0) / 1e6,
        )
        return manifest

    def _save_plain(self, checkpoint: dict[str, Any], url: str, options: dict[str, Any]) -> None:
        """Outside ``fit``: one synchronous ``torch.save`` file, as ``TorchCheckpointIO``
        writes it, so every Lightning tool reads it; written atomically (layout.py)."""
        if self._group_rank != 0:
            return  # collective saves: every rank calls, rank 0 writes the single file
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_file_atomic(Store(url, options), buffer.getvalue())
        log.info("lightning_preempt: saved %s synchronously as a plain Lightning checkpoint (outside fit)", url)

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            err = pending.exception()
            if err is not None:
                raise CheckpointWriteError(
                    f"the previous checkpoint save failed: {str(err).splitlines()[0] if str(err) else repr(err)}",
                    path=getattr(err, "path", None),
                    hint=getattr(err, "hint", None) or "Check the storage; earlier committed checkpoints are intact.",
                ) from err

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
        trusted = self.trust_checkpoints if weights_only is None else not weights_only
        self.wait()
        url = self._aliases.get(str(path), str(path))
        store = Store(url, self.storage_options)
        # A plain Lightning file; on an object store also one that replaced a checkpoint
        # directory whose objects are still being deleted (its manifest went first).
        if not store.exists(MANIFEST_NAME) and store.fs.isfile(store.path()):
            # As Lightning's _load does, but through our storage options (credentials).
            with store.fs.open(store.path(), "rb") as f:
                return torch.load(f, map_location=map_location or "cpu", weights_only=not trusted)  # type: ignore[no-any-return]
        resolved = self._resolve(url)
        if resolved is None:
            raise self._not_found(store)
        target, verified = resolved
        fallback = self._fallbacks.get(str(path))
        if fallback is None and store.exists() and not store.exists(MANIFEST_NAME):  # a directory of checkpoints

            def fallback(excluded: list[str]) -> str | None:
                info = newest_valid(url, self.storage_options, verify="sizes", exclude=excluded)
                return info.path if info is not None else None

        def load(at: str, at_verified: bool) -> dict[str, Any]:
            return load_full_checkpoint(
                Store(at, self.storage_options),
                rank=pdist.rank(),
                verify=self.verify_on_load and not at_verified,
                trusted=trusted,
                map_location=map_location,
            )

        checkpoint, self.loaded_from = load_agreed(load, target, verified, fallback, self._group)
        return checkpoint

    @staticmethod
    def _not_found(store: Store) -> NotACheckpointError:
        if not store.exists():
            # Also a FileNotFoundError, like Lightning's own plugin for a missing ckpt_path.
            return CheckpointNotFoundError("no checkpoint exists at this path", path=store.url, hint=_LOAD_HINT)
        return NotACheckpointError("no committed checkpoint found", path=store.url, hint=_LOAD_HINT)

    def resolve(self, path: Any) -> str | None:
        """The committed checkpoint ``path`` means (alias, checkpoint dir, or newest in a
        directory of checkpoints), or ``None`` when it is none of ours."""
        resolved = self._resolve(self._aliases.get(str(path), str(path)))
        return resolved[0] if resolved is not None else None

    def _resolve(self, url: str) -> tuple[str, bool] | None:
        """``(checkpoint url, already verified)``; each checkpoint is read for its CRC32C once."""
        store = Store(url, self.storage_options)
        if store.exists(MANIFEST_NAME):
            return url, url in self._verified
        if store.isdir():
            # Manifest and sizes only: the CRC32C is checked while loading (one read of
            # every byte); a mismatch there falls back to the next one (load_agreed).
            info = newest_valid(url, self.storage_options, verify="sizes" if self.verify_on_load else False)
            if info is not None:
                return info.path, False
        return None

    def load_sharded(self, path: Any, templates: dict[str, Any], process_group: Any = None) -> dict[str, Any]:
        """Load a checkpoint into sharded ``templates`` in place (collective; see
        :func:`lightning_preempt.reader.load_sharded_checkpoint`)."""
        self.wait()
        url = self._aliases.get(str(path), str(path))
        resolved = self._resolve(url)
        if resolved is None:
            raise self._not_found(Store(url, self.storage_options))
        target, verified = resolved
        return load_sharded_checkpoint(
            Store(target, self.storage_options),
            templates,
            rank=pdist.rank(),
            verify=self.verify_on_load and not verified,
            process_group=process_group,
            trusted=self.trust_checkpoints,
            verify_group=self._group,  # each rank CRC-checks a share of the files
        )

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete whatever is at ``path`` (our checkpoint directory, a plain ``.ckpt`` file,
        a symlink) after every pending write: a delete never overtakes a save. Failures are
        logged with the path, never raised into training. Synchronous after :meth:`teardown`
        and before the first save.
        """
        if self._group_rank != 0:
            return
        url = str(path)
        if not self.history and self._pending is None and not self._writer.running:
            # Never saved: before setup (the ddp_spawn parent removes the workers' weights
            # file through its own copy of the plugin): nothing to order after, no thread.
            self._remove(url)
            return
        self.submit(lambda: self._remove(url))

    def _remove(self, url: str) -> None:
        try:
            store = Store(url, self.storage_options)
            if store.is_local and (os.path.islink(store.path()) or os.path.isfile(store.path())):
                remove_local(store.path())  # a link goes, never what it points to
            elif store.exists(MANIFEST_NAME) or store.isdir():
                remove_checkpoint_dir(store)  # manifest first: never half-deleted yet committed
            elif store.exists():
                store.fs.rm_file(store.path())
            else:
                log.debug("lightning_preempt: nothing to remove at %s", url)
                return
            log.debug("lightning_preempt: removed checkpoint %s", url)
        except Exception as err:
            log.error(
                "lightning_preempt: could not remove checkpoint %s: %s: %s\nHINT: check permissions and the "
                "storage; delete it by hand if it is no longer needed.",
                url,
                type(err).__name__,
                err,
            )

    def submit(self, job: Any) -> Future[Any]:
        """Run ``job`` on the writer thread after every pending save and delete
        (at once on this thread after :meth:`teardown`)."""
        if not self._closed:
            return self._writer.submit(job)
        done: Future[Any] = Future()
        try:
            done.set_result(job())
        except BaseException as err:
            done.set_exception(err)
        return done

    def pending_failed(self) -> bool:
        """Whether the save in flight already failed (non-blocking; polled at step boundaries)."""
        pending = self._pending
        return pending is not None and pending.done() and pending.exception() is not None

    def wait(self) -> Manifest | None:
        """Block until every pending save is committed; re-raise a writer error once."""
        pending = self._pending
        self._wait_pending()
        self._writer.drain()
        return pending.result() if pending is not None else None

    def wait_drained(self, timeout_s: float | None = None) -> bool:
        """Two tiers: wait for local commits, then for queued drains to the remote tier (at
        most ``timeout_s``; a drain still running then gives up). Returns whether all finished."""
        self.wait()
        return self.tiers.wait(timeout_s) if self.tiers is not None else True

    def set_tiers(
        self, remote_root: str | None, *, keep_last_n: int | None = None, group: pdist.ProcessGroup | None = None
    ) -> None:
        """Two tiers: the remote root that maps to ``local_dirpath``, per-tier retention, and
        a gloo group for the drain thread alone (collective when given)."""
        if self.tiers is not None:
            self.tiers.configure(remote_root, keep_last_n, group)

    @override
    def teardown(self) -> None:
        """Wait for pending saves, deletes and drains, then stop the threads. From now on
        saves and removes are synchronous (see the class docstring)."""
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.close()
            if self.tiers is not None:
                self.tiers.close()
