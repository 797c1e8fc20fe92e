"""The engine: preemption safety for a training loop, whatever framework runs it.

It owns the policy (when and where to save, what to resume, the agreement of the ranks,
retention, the lease; the emergency snapshot and exit in engine/emergency.py); the mechanism
is below it. Call order:
docs/design.md "The engine's call order".
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from lightning_preempt.catalog.retention import retain
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine import emergency, fresh_start, tier_policy
from lightning_preempt.engine.agreed_config import check_ranks_agree
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.engine.failures import FailureDetector, start_detector
from lightning_preempt.engine.ledger_writer import Ledger, record_drain, record_save, start_fields
from lightning_preempt.engine.loss_bound import Copy
from lightning_preempt.engine.memory_tier import MEMORY_HINT, MemoryTier
from lightning_preempt.engine.runtime import (
    Runtime,
    listed_at_setup,
    preflight,
    warn_about_newer_checkpoints,
    warn_without_periodic_saves,
)
from lightning_preempt.preemption.controller import Preempted, PreemptionController
from lightning_preempt.preemption.deadline import GraceCheck
from lightning_preempt.preemption.notices import make_sources
from lightning_preempt.preemption.sources import PreemptionSource
from lightning_preempt.resume.resolver import ResumeResolver, ResumeTarget
from lightning_preempt.save.order import Kind, SaveOrder
from lightning_preempt.save.saver import Saver

log = logging.getLogger(__name__)


class Engine:
    """Periodic saves, the agreed emergency snapshot and resume, for any training loop.

    Args:
        config: the validated options (:class:`~lightning_preempt.engine.config.PreemptionConfig`).
    """

    def __init__(self, config: PreemptionConfig) -> None:
        self.config = config
        self.controller = PreemptionController(config, config.sources, on_notice=config.on_notice)
        self.resolver = ResumeResolver(config.dirpath, config.storage_options, config.local_dirpath,
                                       memory_dirpath=config.memory_dirpath,
                                       retries=config.retries, backoff_s=config.backoff_s)  # fmt: skip
        #: Tier 0 in host memory (docs/tier0.md), with ``tier0_every_n_steps``.
        self.memory: MemoryTier | None = None
        if config.memory_dirpath is not None and config.tier0_every_n_steps is not None:
            self.memory = MemoryTier(config.memory_dirpath, config.tier0_every_n_steps, dirpath=config.dirpath)
        self.grace = GraceCheck(config.grace_period_s)
        self.local_dirpath = config.local_dirpath  # the plugin's local tier, once set up
        #: Called on every rank as ``hook(step)`` after the emergency snapshot committed and
        #: before the drain gets the rest of the grace period (the peer replica).
        self.snapshot_hooks: list[Callable[[int], None]] = []
        self.resumed_from: str | None = None
        #: The highest step a checkpoint directory in ``dirpath`` carried at set-up (agreed; None:
        #: unknown, or no lease). A save of a higher step needs no look at the storage for its path.
        self._highest_listed: int | None = None
        self.run_id: str | None = None  # set in setup; recorded in every manifest of this run
        self.saving: SaveOrder | None = None  # the save handed to the front-end now (its kind: in the checkpoint)
        self.last_saved_step: int | None = None
        self.last_saved_path: str | None = None
        self.leader = True
        self._last_save_time = time.monotonic()
        self._last_seen_step: int | None = None
        self._notice_sources: list[PreemptionSource] = []
        self._runtime = Runtime()  # a fresh one per set-up
        self._saver: Saver | None = None
        self._save: Callable[[SaveOrder], None] | None = None
        self._warned_no_interval = False
        #: The goodput ledger (written by rank 0 with ``config.ledger``; else one that records nothing).
        self.ledger = Ledger.off()
        #: The heartbeats that catch a rank lost without a signal (engine/failures.py), once set up.
        self.detector: FailureDetector | None = None
        #: Steps this rank holds besides its committed saves (a tier 0 adds its copies here).
        self.held_steps: list[Callable[[], list[int]]] = []

    def __getstate__(self) -> dict[str, Any]:
        # Process groups, the lease thread, the saver and the save function belong to one run.
        return {**self.__dict__, "_runtime": Runtime(), "_saver": None, "_save": None, "ledger": Ledger.off(),
                "detector": None}  # fmt: skip

    # ---- 1. before the process group ----------------------------------------------------
    def peek(self) -> bool:
        """Whether to resume: ``resume`` is on and ``dirpath`` (or the local tier) holds a
        committed checkpoint. Every rank; before any collective is possible."""
        return self.config.resume and self.resolver.peek().has_checkpoint

    # ---- 2. set-up -------------------------------------------------------------------
    def setup(
        self,
        saver: Saver,
        *,
        save: Callable[[SaveOrder], None],
        route_saves: Callable[[Any], object],
        leader: bool,
        local_rank: int = 0,
        verify_on_load: bool = True,
    ) -> ResumeTarget | None:
        """Collective set-up (docs/design.md "The engine's call order").

        Args:
            saver: the process's save pipeline (the plugin's).
            save: saves the current training state as a :class:`SaveOrder` says, by handing the
                order to ``saver.save`` (docs/design.md "A save, hop by hop").
            route_saves: called with the gloo group reserved for the saver's job thread;
                makes every rank save its share (``saver.enable_collective``) where the
                framework allows it.
            leader: this is global rank 0 (retention, requeue, the upload on start).
            local_rank: this process's rank on its node (one watcher of cloud notices per node).
            verify_on_load: the load checks every byte, so choosing checks manifests and sizes
                only and a damaged choice falls back to the next (docs/resume-speed.md).
        """
        config = self.config
        self._saver, self._save, self.leader = saver, save, leader
        rt = self._runtime = Runtime()
        writer_group = rt.new_group()
        group = rt.agree_group = rt.new_group()
        stage_group = rt.new_group()  # the training thread's gather before staging (save/saver.py)
        check_ranks_agree(config, group, two_tier=self.local_dirpath is not None or saver.tiers is not None,
                          sharded_keys=saver.sharded_keys, verify_on_load=verify_on_load)  # fmt: skip
        self.controller.bind(group)
        route_saves(writer_group)
        saver.use_stage_group(stage_group)  # (dropped where route_saves made no collective saves)
        self.local_dirpath = tier_policy.configure_tiers(
            saver, dirpath=config.dirpath, local_dirpath=self.local_dirpath, keep_last_n=config.keep_last_n,
            new_group=rt.new_group,
        )  # fmt: skip
        if self.memory is not None:  # collective: every rank has the same config
            floor = (lambda: tier_policy.newest_disk_step(config, saver.tiers)) if config.resume else None
            schedule = self.controller.schedule  # auto's votes are read up to k (+1 overlapped) boundaries late
            self.resolver.memory_usable = self.memory.setup(
                group, leader=leader, new_group=rt.new_group, restore_floor=floor,
                agree_steps=lambda: schedule.latency_steps,
            )  # fmt: skip
            if self.memory.held not in self.held_steps:
                self.held_steps.append(self.memory.held)
        # A listing that kept failing on any rank stops every rank here, before step 1.
        asked = self.resolver.peeked is not None  # the front-end asked (no explicit checkpoint given)
        resuming = config.resume and self.resolver.agree_on_peeks(group)
        self.resolver.peeked = None  # one peek per set-up
        if config.probe_storage:
            preflight(config.dirpath, config.storage_options, self.local_dirpath, group)
        if config.lease:
            rt.take_lease(config, leader=leader)
            if config.resume and not resuming:
                # The peek was made before the lease was ours: the job that held it may have
                # committed since (a requeued job waiting for its predecessor to let go). Not
                # when the front-end never asked (an explicit checkpoint was given).
                resuming = self.resolver.look_again(group, asked=asked)
        target = self.resolver.target(group, tiers=saver.tiers, verify_on_load=verify_on_load) if resuming else None
        if target is None and asked and config.resume:
            fresh_start.refuse_if_progress_lost(config, group)  # never a silent fresh start
        if target is not None:
            self.resumed_from, self.last_saved_step = target.path, target.step
        # A resumed run continues the run it resumed from; a fresh one gets a new id.
        continued = target.run_id if target is not None else None
        self.run_id = saver.run_id = agree.decide(lambda: continued or uuid.uuid4().hex, group)
        if self.memory is not None:  # before any copy: the resolver takes only this job's
            self.memory.claim(config.dirpath, self.run_id)
        if saver.tiers is not None:
            saver.tiers.run_id = self.run_id
            saver.tiers.on_drain = lambda drain: record_drain(self.ledger, drain)  # ledger looked up late: replaced below
            if leader:
                tier_policy.upload_local_only(saver.tiers, config.dirpath)
        self.ledger.close()
        self.ledger = Ledger(config.dirpath, config.storage_options, self.run_id, enabled=leader and config.ledger)
        newest, highest = agree.decide(lambda: listed_at_setup(config), group, what="reading the newest manifest")
        # (without the lease another job may write the same dirpath: every save looks at the storage)
        self._highest_listed = highest if config.lease else None
        self.grace.check_manifest(newest)
        self.controller.signal_flag.clear()
        if config.notice_names and not self._notice_sources:  # one watcher per node: local rank 0
            self._notice_sources = make_sources(config.notice_names, local_rank=local_rank)
            self.controller.sources.extend(self._notice_sources)
        self.controller.start()
        if self.detector is None:
            self.detector = start_detector(config, group, run_id=self.run_id or "", ledger=self.ledger, held=self._held,
                                           step=lambda: self._last_seen_step or 0)  # fmt: skip
        return target

    def _held(self) -> list[int]:
        """The steps this rank can resume from: its committed saves, the step it resumed from,
        and what the other sources (``held_steps``) report. Called on the heartbeat thread."""
        steps = {r.step for r in emergency.committed(self.saver.history)}
        if self.resumed_from is not None and self.last_saved_step is not None:
            steps.add(self.last_saved_step)
        for source in list(self.held_steps):
            steps.update(source())
        return sorted(steps)

    # ---- 3. the state is loaded ------------------------------------------------------------
    def start(self, step: int, *, loaded_from: str | None) -> None:
        """Every rank, once the state of ``step`` is loaded (``loaded_from``: what the load
        really read, after any fall-back), just before the first step."""
        self.controller.start()
        self._last_save_time = time.monotonic()
        self._last_seen_step = step
        if self.memory is not None:
            self.memory.resumed(step)  # what was loaded is held: the loss bound counts from it
        if self.resumed_from is not None and loaded_from not in (None, self.resumed_from):
            # the chosen checkpoint failed its check while loading: an older one was loaded
            self.resumed_from, self.last_saved_step = loaded_from, step
        if self.last_saved_step is None and step > 0:
            self.last_saved_step = step  # resumed from a path the user gave
            if self.leader:
                warn_about_newer_checkpoints(self.config, step)
        if self.leader and not self._warned_no_interval:
            self._warned_no_interval = True  # once per callback, not once per fit
            warn_without_periodic_saves(self.config, step)
        self.ledger.add(
            "start",
            **start_fields(step, self.resumed_from, pdist.world_size(self._group), self.config, self.local_dirpath,
                           memory_dirpath=self.config.memory_dirpath),
        )  # fmt: skip
        self.check(step)  # a signal during start-up or restore: nothing new to save

    # ---- 4. step boundaries ----------------------------------------------------------------
    def step_end(self, step: int) -> None:
        """Every rank, after every training batch (``step``: optimizer steps so far)."""
        if step == self._last_seen_step:
            return  # mid gradient-accumulation: no optimizer step happened, nothing to snapshot
        self._last_seen_step = step
        self.ledger.progress(step)
        now = time.monotonic()
        every_s = self.config.every_n_seconds
        local_due = every_s is not None and now - self._last_save_time >= every_s
        vote = self.memory.vote(step, self.saver) if self.memory is not None else 0
        decision = self.controller.at_boundary(now, save_due=local_due, stop=self._must_stop(), tier0=vote)
        if decision.stop:
            self._stop()
        if decision.preempt:
            emergency.preempt(self, step)  # raises Preempted
        every_n = self.config.every_n_train_steps
        if (every_n is not None and step % every_n == 0) or decision.save_due:
            self.save(step, kind="notice" if decision.notice_snapshot else "periodic")
            if decision.notice_snapshot:
                emergency.report_notice_snapshot(self, step)
        elif self.memory is not None and (self.memory.due(step) or self.memory.agreed(decision.tier0)):
            self.save_memory(step)
        if self.memory is not None and self.memory.over(step):
            self._hold_at_bound(step)

    def _hold_at_bound(self, step: int) -> None:
        """Every rank, at the step where tier 0's loss bound would break (engine/loss_bound.py):
        wait for the copy in flight, or make one now and wait, before the next step runs."""
        memory = self.memory
        assert memory is not None
        if memory.settle(step, self._group):
            return
        self.save_memory(step, at_bound=True)
        if not memory.settle(step, self._group):
            memory.give_up(step)

    def check(self, step: int) -> None:
        """Every rank, at boundaries other than training steps: agree now, act on preemption."""
        if self.controller.schedule.bound and self.controller.now().preempt:
            emergency.preempt(self, step)  # raises Preempted

    def _must_stop(self) -> bool:
        """This rank's reason to stop training: its save failed, or the lease was lost."""
        self._forgive_memory_copy(wait=False)
        lease = self._runtime.lease
        return self.saver.pending_failed() or (lease is not None and lease.lost)

    def _stop(self) -> None:
        """Every rank raises the same error: the lease's, else the failed save's."""
        lease = self._runtime.lease
        with self.ledger.records_errors(self._last_seen_step or 0):
            agree.decide(lambda: lease.check() if lease is not None else None, self._group, what="holding the lease")
            self.wait()

    # ---- saving ------------------------------------------------------------------------------
    @property
    def saver(self) -> Saver:
        assert self._saver is not None, "Engine.setup() first"
        return self._saver

    @property
    def _group(self) -> Any:
        return self._runtime.agree_group

    def wait(self) -> None:
        """Every rank: wait for pending saves; a failure on any rank raises on every rank."""
        agree.agree(self.saver.wait, self._group, what="saving the checkpoint")

    def save(self, step: int, kind: Kind = "periodic") -> None:
        """Every rank: save ``step`` at a fresh path (asynchronous), unless it is saved already."""
        if step == self.last_saved_step:
            return
        self._forgive_memory_copy(wait=True)
        path = tier_policy.fresh_path(self.saver.tiers, self.config.dirpath, step, self.config.storage_options,
                                       self._group, highest_listed=self._highest_listed)  # fmt: skip
        saver, before = self.saver, self.saver.history[-1:]
        self._hand_over(SaveOrder(path, kind, watched=False))  # nothing looks for it before its commit
        self.last_saved_step, self.last_saved_path, self._last_save_time = step, path, time.monotonic()
        if self.memory is not None and saver.tiers is None:  # one durable tier: it holds step once committed
            after = saver.history[-1:]
            self.memory.loss.started(Copy(step, after[0] if after and after != before else None))
        record_save(self.ledger, saver, before, kind)
        if self.leader and saver.tiers is None:  # two tiers: each drain job applies retention per tier
            # Queued behind the save: runs after it committed (or failed: the old ones are kept).
            config = self.config
            saver.submit(lambda: retain(config.dirpath, config.keep_last_n, config.storage_options,
                                        run_id=self.run_id))  # fmt: skip
        self.grace.check_records(saver.history[:-1])

    def save_memory(self, step: int, *, at_bound: bool = False) -> None:
        """Every rank: copy ``step`` to tier 0 (asynchronous, queued behind the saver's saves in
        flight, as a periodic save); on several nodes the peer copy follows it (memory_tier.py).
        ``at_bound``: the loss bound needs this copy, even where a disk save of ``step`` began."""
        assert self.memory is not None, "Engine.setup() first"
        if step == self.last_saved_step and not at_bound:
            return  # on a disk tier already
        self._forgive_memory_copy(wait=True)
        path = self.memory.path(step, self._group)
        if path is None:
            return  # the previous peer copy still runs on some rank: skipped on every rank
        before = self.saver.history[-1:]
        self._hand_over(SaveOrder(path, "tier0"))
        after = self.saver.history[-1:]
        self.memory.started(step, path, after[0] if after and after != before else None)
        record_save(self.ledger, self.saver, before, "tier0", tier="memory")
        self.memory.after_copy(self.saver, path, self.run_id, leader=self.leader)

    def _hand_over(self, order: SaveOrder) -> None:
        """The front-end saves the current state as ``order`` says (every rank)."""
        assert self._save is not None, "Engine.setup() first"
        self.saving = order
        try:
            self._save(order)
        finally:
            self.saving = None

    def _forgive_memory_copy(self, *, wait: bool) -> None:
        """A failed tier-0 copy (a full tmpfs) does not stop training: logged, the disk tiers
        go on. Each rank takes back its own copy's failure; a copy whose commit did not
        happen is never resumed from (no manifest)."""
        memory = self.memory
        if memory is None or memory.in_flight is None:
            return
        err = self.saver.forget_failed(wait=wait)
        path = memory.in_flight
        if err is None and not wait:
            return  # running or done well: looked at again at the next boundary or save
        memory.in_flight = None
        if err is not None:
            log.error("lightning_preempt: the tier-0 copy to %s failed (%s); training goes on\nHINT: %s",
                      path, str(err).splitlines()[0] if str(err) else repr(err), MEMORY_HINT)  # fmt: skip

    # ---- 5./6. the end ---------------------------------------------------------------------------
    def finish(self, step: int) -> None:
        """Every rank, when training ends normally: the final save, then wait for every commit."""
        self.controller.flush()  # every rank completes its overlapped exchange
        if self.config.save_on_train_end and step != self.last_saved_step and step > 0:
            self.save(step, kind="final")
        with self.ledger.records_errors(step):
            self.wait()
        self.ledger.add("finish", step=step)

    def close(self, *, finish_saves: bool = False, error: BaseException | None = None) -> None:
        """Every rank: stop the sources, release the lease and the process groups.
        ``finish_saves``: first finish the saver's writes and drains (they use the groups)
        — after an exception (``error``: it, for the ledger), when no framework teardown did it."""
        self.controller.stop()
        if error is not None and self.detector is not None:
            self.detector.after_error(error)  # a lost peer: the verdict ends the process from here
        if self.detector is not None:
            self.detector.stop()
            self.detector = None
        if error is None:  # a SIGTERM after training ends the process with exit_code, no traceback
            self.controller.after_training(leader=self.leader, safe_step=lambda: emergency.safe_step(self))
        if error is not None and not isinstance(error, Preempted):
            self.ledger.error(self._last_seen_step or 0, error)
        if finish_saves and self._saver is not None:
            try:
                self._saver.close()
            except Exception as err:
                log.error("lightning_preempt: finishing the pending saves failed: %s", err)
        # bounded: a ledger that cannot be written never holds the exit (nor the grace period)
        self.ledger.close(min(10.0, self.controller.budget()) if self.controller.origin is not None else 10.0)
        self._runtime.release()
