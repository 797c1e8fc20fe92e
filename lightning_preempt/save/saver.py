"""The save pipeline of one process: stage, queue, write, commit. Framework-neutral.

How the steps overlap, and the call order: docs/design.md "The save pipeline".
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from typing import Any

import torch

from lightning_preempt.catalog.ownership import remove_path
from lightning_preempt.catalog.verified import mark_verified
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import earlier_save_failed
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.shares import ShareMemo, own_share
from lightning_preempt.format.skeleton import DEFAULT_SHARDED_KEYS, Splitter, split_checkpoint
from lightning_preempt.format.structure import Structure, Structures
from lightning_preempt.read.load import gc_paused
from lightning_preempt.save.history import HISTORY_KEPT, SaveRecord, checkpoint_step
from lightning_preempt.save.idle import Gate
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.staging.budget import Split, StagingBudget
from lightning_preempt.staging.overlap import InFlightCopy, Overlap
from lightning_preempt.staging.stager import HostStager
from lightning_preempt.storage.store import Store
from lightning_preempt.tiers.two_tier import TwoTier
from lightning_preempt.write.commit import SaveRequest, write_checkpoint
from lightning_preempt.write.jobs import JobQueue
from lightning_preempt.write.planning import PlanCache
from lightning_preempt.write.replace import ensure_exists, write_file_atomic
from lightning_preempt.write.skeleton_bytes import skeleton_bytes

log = logging.getLogger(__name__)


class Saver:
    """Sharded, staged, asynchronous, committed saves (docs/design.md "The save pipeline").

    Its options are the plugin's, documented once on their fields (engine/config.py
    ``CheckpointIOConfig``; ``overlap_staging`` resolved); ``pin_memory``: pin staging
    buffers, ``None``: when CUDA is available.
    """

    def __init__(
        self,
        storage_options: dict[str, Any],
        *,
        pin_memory: bool | None = None,
        host_memory_budget: int | float | None = None,
        pinned_memory_budget: int | float | None = None,
        thread_count: int = 1,
        overlap_staging: bool = False,
    ) -> None:
        self.storage_options = storage_options
        self.thread_count = thread_count
        #: top-level checkpoint keys whose tensors go to the DCP shards (a save's order may add some)
        self.sharded_keys = DEFAULT_SHARDED_KEYS
        self.stager = HostStager(pin_memory)
        self.budget = StagingBudget(host_memory_budget, pinned_memory_budget)
        self.overlap = Overlap(overlap_staging)
        #: DCP plans reused while the staged state keeps its structure (write/planning.py)
        self.plan_cache = PlanCache()
        self.stager.on_release = self.plan_cache.forget_views
        self._structures = Structures()  # each save's one structure key, which every stage's caches go by
        self._shares = ShareMemo()  # who stages which replicated tensor, per structure key
        self._splitter = Splitter()  # the state's structure, while it holds (format/skeleton.py)
        self.jobs = JobQueue()
        self.history: list[SaveRecord] = []
        #: recorded in every manifest; retention never deletes another run's checkpoints
        self.run_id: str | None = None
        self.tiers: TwoTier | None = None
        self._tier_args: dict[str, Any] | None = None
        self.group: pdist.ProcessGroup | None = None
        #: the training thread's own group for the share fingerprints (:meth:`use_stage_group`)
        self.stage_group: pdist.ProcessGroup | None = None
        self.rank = 0  # this process's rank in ``group``
        self.closed = False
        self._pending: Future[Manifest] | None = None
        self._written: threading.Event | None = None  # the pending save's tensors are written
        self._committing: Future[Manifest] | None = None  # the save before it, maybe still committing

    def __getstate__(self) -> dict[str, Any]:
        """Configuration only: a copy (``ddp_spawn``, ``deepcopy``) has no pending save, group,
        history or drain thread, and nothing derived from this process's saves: no staging
        buffers (host memory, maybe pinned, maybe GBs), no plans (they name this process's
        buffers; made again by :meth:`__setstate__`), no budget resolved here (another host has
        another ``MemAvailable``), no copy in flight, no stable tensors (the front-end declares
        them again in the process that trains). The job queue drops its thread itself."""
        state = self.__dict__.copy()
        state.update(_pending=None, _written=None, _committing=None, group=None, stage_group=None, rank=0,
                     history=[], tiers=None, _shares=ShareMemo(), _splitter=Splitter())  # fmt: skip
        state.update(
            _structures=Structures(),
            stager=HostStager(self.stager.pin_memory),
            budget=StagingBudget(self.budget.host_option, self.budget.pinned_option),
            overlap=Overlap(self.overlap.enabled),
            plan_cache=None,
        )
        tiers = self.tiers
        state["_tier_config"] = (tiers.remote_root, tiers.keep_last_n) if tiers is not None else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tier_config = state.pop("_tier_config", None)
        self.__dict__.update(state)
        self.plan_cache = PlanCache()
        self.stager.on_release = self.plan_cache.forget_views
        if self._tier_args is not None:
            self.use_local_tier(**self._tier_args)
            if self.tiers is not None and tier_config is not None:
                # TwoTier.configure is collective; the engine calls it again in its set-up
                self.tiers.remote_root, self.tiers.keep_last_n = tier_config

    def use_local_tier(self, local_root: str, *, max_workers: int = 4, retries: int = 4, backoff_s: float = 1.0) -> None:
        """Two tiers (tiers/two_tier.py): commit to ``local_root`` first, then drain to where each
        save is addressed (``storage_options`` apply there)."""
        self._tier_args = {"local_root": local_root, "max_workers": max_workers, "retries": retries,
                           "backoff_s": backoff_s}  # fmt: skip
        self.tiers = TwoTier(remote_options=self.storage_options, **self._tier_args)

    # ---- wiring ------------------------------------------------------------------------
    def enable_collective(self, group: pdist.ProcessGroup | None) -> None:
        """Every rank calls :meth:`save` from now on; the job thread syncs on ``group`` (a
        gloo group reserved for it). Also re-opens a closed saver (a new ``fit``)."""
        if group is not self.group:  # plans and shares name the old group's ranks
            self.plan_cache.clear()
            self._shares = ShareMemo()
            self.stage_group = None  # it belonged to the old group
        self.group = group
        # Kept: after the run the group is destroyed, yet saves outside it still ask who writes.
        self.rank = pdist.rank(group) if group is not None else 0
        self.closed = False

    def use_stage_group(self, group: pdist.ProcessGroup | None) -> None:
        """Give the training thread a gloo group of its own (the job thread's ranks) for the
        share fingerprints' gather in :meth:`save`: the next save then stages while the previous
        one commits at any number of ranks (docs/design.md "The save pipeline"). Without it a
        collective save waits for the previous commit: two threads' collectives on one group
        meet in different orders on different ranks. Every rank calls it, after
        :meth:`enable_collective` (a new group there drops it)."""
        self.stage_group = group if self.group is not None else None

    def _collective(self) -> bool:
        """Every rank of :attr:`group` saves its share (more than one rank)."""
        return self.group is not None and pdist.world_size(self.group) > 1

    def prepare_staging(self, checkpoint_like: dict[str, Any], *, background: bool = True) -> Future[int]:
        """Allocate and touch this rank's staging buffers now, from the tensors' shapes, so the
        first (maybe the emergency) save only copies. Not collective; call it again when the
        state grows (buffers that fit are kept). The Future holds the bytes newly allocated."""
        tensors, _ = split_checkpoint(checkpoint_like, self.sharded_keys)
        if self._collective():
            tensors = own_share(tensors, pdist.rank(self.group), pdist.world_size(self.group))
        plan = self.budget.split(tensors, self.stager)
        resident = {key: tensors[key] for key in plan.resident}
        return self.stager.prepare(resident, background=background, pinned=plan.pinned)

    def _my_share(self, tensors: dict[str, Any], key: Structure) -> tuple[dict[str, Any], Callable[[], bool]]:
        """This rank's share (DDP; format/shares.py), and the check, after its copy, that every rank
        holds the same tensors: their fingerprints, gathered meanwhile on :attr:`stage_group`
        (without one on the job thread's group, idle here: the previous save has finished)."""
        if not self._collective():
            return tensors, lambda: True
        group = self.group
        fingerprint, mine = self._shares.share(tensors, pdist.rank(group), pdist.world_size(group), key)
        gathered = pdist.start_gather_digests(fingerprint.encode(), self.stage_group if self.stage_group is not None else group)
        return mine, lambda: self._shares.agreed(gathered())

    def _stage(self, tensors: dict[str, Any], defer: bool, key: Structure) -> tuple[Split, dict[str, Any], InFlightCopy | None]:
        plan = self.budget.split(tensors, self.stager, unchanged=self.stager.unchanged(tensors, key))
        resident = tensors if len(plan.resident) == len(tensors) else {k: tensors[k] for k in plan.resident}
        # (a save that streams blocks until the writer has the streamed part: nothing to overlap)
        staged, copying = self.overlap.stage(self.stager, resident, plan.pinned, defer=defer and not plan.streamed, key=key)
        self.budget.staged(plan)
        return plan, staged, copying

    # ---- saving ------------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], order: SaveOrder, *, wait: bool = False) -> None:
        """Stage ``checkpoint`` and queue its write and commit to ``order.url`` (save/order.py);
        returns once the tensors are copied (``order.overlap``: the eager part) and, when
        ``order.watched``, the path exists (``wait``: once it is committed).

        Raises:
            CheckpointWriteError: an earlier save failed (raised once; across ranks the save
                before the previous one, whose outcome every rank knows by then).
        """
        started = time.perf_counter()
        url, options = order.url, dict(order.options)
        record = SaveRecord(url, checkpoint_step(checkpoint), started)
        # The buffers are in use until the previous save's tensors are written; its commit may go
        # on (two tiers: a fallback to the remote tier rereads the buffers)
        self._wait_pending(buffers=self.tiers is None and (not self._collective() or self.stage_group is not None))
        record.waited_s = time.perf_counter() - started
        local_url = self.tiers.local_twin(url) if self.tiers is not None else None
        if self.rank == 0 and order.watched:
            # ``url`` exists when save returns (replace.ensure_exists); with two tiers the training
            # thread touches only the local disk (a remote outage must not stall a step)
            ensure_exists(Store(url, options) if local_url is None else Store(local_url))
        with gc_paused():  # thousands of tensors: no full collections while training waits
            every, skeleton = self._splitter.split(checkpoint, self.sharded_keys + order.sharded_keys)
            key = self._structures.key(every)  # the one "has the structure changed?" of this save
            tensors, agreed = self._my_share(every, key)
            skeleton_data = skeleton_bytes(skeleton)  # torch.save's bytes; freezes the non-tensor state now
            staging_started = time.perf_counter()
            defer = order.overlap and not wait
            plan, staged, copying = self._stage(tensors, defer, key)
            if not agreed() and tensors is not every:
                log.warning("lightning_preempt: ranks hold different tensors; every rank stages all of them")
                tensors = every
                plan, staged, copying = self._stage(tensors, defer, key)
        record.deferred_bytes = copying.bytes if copying is not None else 0
        staged_s = time.perf_counter() - staging_started
        streamed = self.budget.streamed(plan, self.stager)
        if streamed is not None:  # the rest is written from the training state, in the same order
            staged = {key: staged[key] if key in staged else tensors[key].detach() for key in tensors}
        record.bytes = plan.total_bytes + len(skeleton_data)
        record.blocking_s = time.perf_counter() - started
        written = threading.Event()
        request = SaveRequest(url=url, tensors=staged, skeleton=skeleton_data, step=record.step,
                              epoch=int(checkpoint.get("epoch", -1)), storage_options=options,
                              stats={"blocking_s": record.blocking_s}, run_id=self.run_id,
                              streamed=streamed, written=written, structure=key)  # fmt: skip
        self.history.append(record)
        del self.history[:-HISTORY_KEPT]  # a long run saves thousands of times
        write: Callable[[], Manifest] = lambda: self._write(request, record, copying)  # noqa: E731
        if local_url is not None and self.tiers is not None:
            tiers = self.tiers

            def write_to(tier_url: str, tier_options: dict[str, Any]) -> Manifest:
                tier_request = dataclasses.replace(request, url=tier_url, storage_options=tier_options)
                record.error = None  # a local failure followed by a remote fallback that works
                return self._write(tier_request, record, copying)

            write = lambda: tiers.save(write_to, url, local_url, record.step)  # noqa: E731
        gate = Gate(None, 0.0) if wait or streamed is not None else Gate.here(self.history)  # save/idle.py
        self._pending = self.submit(lambda: gate.after(write))  # a periodic write starts once training waits
        self._written = written
        self._pending.add_done_callback(lambda _: written.set())
        if streamed is not None:
            # Training may change the streamed tensors once they are written (or the job ended).
            self._pending.add_done_callback(lambda _: streamed.release())
            streamed.wait()
            record.blocking_s = request.stats["blocking_s"] = time.perf_counter() - started
            self.budget.warn_once(plan, record.blocking_s, staged_s)
        if wait:
            self._wait_pending()

    def _write(self, request: SaveRequest, record: SaveRecord, copying: InFlightCopy | None = None) -> Manifest:
        try:
            if copying is not None:
                copying.wait()  # the deferred copies fill the buffers the writer reads
            # write_checkpoint clears an uncommitted leftover at the path (never mixing old
            # and new files) and replaces a committed checkpoint there (write/replace.py).
            manifest = write_checkpoint(
                request, group=self.group, thread_count=self.thread_count, plan_cache=self.plan_cache
            )
        except BaseException as err:
            record.error = err
            # Every rank meets a failed save (commit.py's agreement): every rank plans the
            # next one afresh, so no rank reuses a plan the coordinator lacks (write/planning.py).
            self.plan_cache.clear()
            raise
        record.committed_s = time.perf_counter() - record.started
        if self.rank != 0:
            return manifest
        mark_verified(request.url, manifest)  # CRC32C computed from the bytes written: retention need not re-read
        log.info(
            "lightning_preempt: committed %s (step %d): blocked %.3fs, committed after %.3fs, %.1f MB at %.0f MB/s",
            request.url, request.step, record.blocking_s, record.committed_s, record.bytes / 1e6,
            (record.throughput_bps or 0.0) / 1e6,
        )  # fmt: skip
        return manifest

    def save_plain(self, checkpoint: dict[str, Any], url: str, options: dict[str, Any]) -> None:
        """One synchronous ``torch.save`` file, as Lightning's ``TorchCheckpointIO`` writes it
        (every Lightning tool reads it), written atomically (write/replace.py). With
        collective saves every rank calls and rank 0 writes."""
        if self.rank != 0:
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_file_atomic(Store(url, options), buffer.getvalue())
        log.info("lightning_preempt: saved %s synchronously as a plain Lightning checkpoint (outside fit)", url)

    def settle(self) -> None:
        """Order whatever comes next after the overlapped copy in flight (staging/overlap.py):
        call it before changing parameters or optimizer state outside an optimizer step."""
        self.overlap.settle()

    def _wait_pending(self, *, buffers: bool = False) -> None:
        """Wait for the saves in flight (``buffers``: only until the last one's tensors are
        written or its job ended; its commit may go on); raise a finished save's error once.
        Across ranks only the outcome every rank knows is raised: the save before the last
        (one job thread writes the last one's tensors only after that one ended). Whether the
        last one ended differs from rank to rank; raising it on some would leave the others in
        the next collective: the next save raises it, or :meth:`wait`, or, through
        :meth:`pending_failed`, the agreed step boundary."""
        self.overlap.settle()
        earlier, last = self._committing, self._pending
        if buffers and self._written is not None:
            self._written.wait()
            settled = [f for f in (earlier,) if f is not None]
            if last is not None and last.done() and not self._collective():
                settled.append(last)  # one rank: nobody to disagree with
                last = None
            self._committing = last
        else:
            settled = [f for f in (earlier, last) if f is not None]
            wait_all(settled)
            self._committing = None
        self._pending = self._written = None
        err = next((e for f in settled if (e := f.exception()) is not None), None)
        if err is not None:
            raise earlier_save_failed(err, "the previous checkpoint save failed") from err

    def remove(self, url: str) -> None:
        """Delete what is at ``url`` once every pending write is done (a delete never overtakes
        a save): our checkpoint directory (only if it holds nothing foreign), a plain
        checkpoint file, a symlink (never what it points to). Failures are logged with the
        path, never raised into training. At once when nothing was ever saved."""
        if self.rank != 0:
            return
        if self.idle:
            remove_path(Store(url, self.storage_options))  # e.g. the ddp_spawn parent's copy: no thread to start
            return
        self.submit(lambda: remove_path(Store(url, self.storage_options)))

    # ---- everything else queues behind the saves ---------------------------------------
    def submit(self, job: Any) -> Future[Any]:
        """Run ``job`` on the job thread after every pending save and delete (at once on this
        thread after :meth:`close`)."""
        if not self.closed:
            return self.jobs.submit(job)
        done: Future[Any] = Future()
        try:
            done.set_result(job())
        except BaseException as err:
            done.set_exception(err)
        return done

    @property
    def idle(self) -> bool:
        """Nothing was ever saved and no job thread runs (before the first ``fit``)."""
        return not self.history and self._pending is None and self._committing is None and not self.jobs.running

    def pending_failed(self) -> bool:
        """Whether the save in flight already failed (non-blocking; polled at step boundaries)."""
        return any(f is not None and f.done() and f.exception() is not None for f in (self._committing, self._pending))

    def forget_failed(self, *, wait: bool = False) -> BaseException | None:
        """Take back the save in flight when it failed, so that it is never raised later (a
        best-effort tier's copy: docs/tier0.md). ``wait``: wait for it to finish first.
        Returns its error, or ``None`` (none in flight, still running, or it succeeded)."""
        pending = self._pending  # (not the save before it: its failure is raised as usual)
        if pending is None or (not wait and not pending.done()):
            return None
        err = pending.exception()  # waits when it is still running
        if err is not None and self._pending is pending:
            self._pending = None
        return err

    def wait(self) -> Manifest | None:
        """Block until every pending save and job finished; re-raise a save's error once."""
        pending = self._pending
        self._wait_pending()
        self.jobs.drain()
        return pending.result() if pending is not None else None

    def wait_drained(self, timeout_s: float | None = None) -> bool:
        """Two tiers: wait for local commits, then for queued drains to the remote tier (at
        most ``timeout_s``; a drain still running then gives up). Returns whether all finished."""
        self.wait()
        return self.tiers.wait(timeout_s) if self.tiers is not None else True

    def close(self) -> None:
        """Wait for pending saves, jobs and drains, then stop the threads."""
        try:
            self.wait()
        finally:
            self.closed = True
            self.overlap.close()
            self.jobs.close()
            if self.tiers is not None:
                self.tiers.close()

