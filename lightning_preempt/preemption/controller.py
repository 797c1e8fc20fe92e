"""The preemption controller: framework-neutral policy for "are we being reclaimed, and what
now". It owns the sources, the agreement schedule, the timeline and the emergency sequence,
which is unconditional (a scheduler must always see a preemption as one): whatever the
snapshot does, it logs the safe step, requeues when configured and raises :class:`Preempted`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Literal, NoReturn, Protocol

from lightning_preempt.collective.groups import ProcessGroup
from lightning_preempt.preemption import quick_exit
from lightning_preempt.preemption.deadline import grace_margin
from lightning_preempt.preemption.requeue import AGENT_REQUEUES, absorb_requeue_term, requeue_slurm
from lightning_preempt.preemption.schedule import AgreementSchedule
from lightning_preempt.preemption.signals import SignalFlag, hand_back, take_over
from lightning_preempt.preemption.sources import Notice, PreemptionSource

log = logging.getLogger(__name__)


#: With ``agree_every_n_steps="auto"``, the longest a signal waits for every rank to act on it (or 2 steps
#: where a step is longer): 52 of 52 trials within it (docs/benchmarks.md). Was ``agree_interval_s``.
AGREE_INTERVAL_S = 0.3
#: The longest ``scontrol requeue`` may take (also bounded by the grace period). Was ``requeue_timeout_s``.
REQUEUE_TIMEOUT_S = 10.0


class Preempted(SystemExit):
    """Raised on every rank after the emergency snapshot; exits with the configured code."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every rank does at this boundary (the same on every rank)."""

    preempt: bool = False
    save_due: bool = False
    stop: bool = False  # a rank's save failed or its lease was lost: raise the agreed error
    notice_snapshot: bool = False  # this rank asked for this save: a notice with on_notice="continue"
    tier0: int = 0  # the agreed tier-0 vote (auto K; engine/memory_tier.py ``MemoryTier.agreed`` reads it)


class ControllerSettings(Protocol):
    """What the controller reads of its configuration (the engine's validated
    ``PreemptionConfig`` is one; see the engine's docstring for what each means)."""

    @property
    def signums(self) -> tuple[signal.Signals, ...]: ...
    @property
    def grace_period_s(self) -> float: ...
    @property
    def exit_code(self) -> int: ...
    @property
    def requeue(self) -> bool | None: ...
    @property
    def agree_every_n_steps(self) -> int | Literal["auto"]: ...
    @property
    def overlap_agreement(self) -> bool: ...


def _noted(signum: signal.Signals) -> None:
    """A signal while the exit is under way: :data:`signals.LATE` counts it; nothing more."""


class PreemptionController:
    """Sources -> agreement -> decisions; and the emergency sequence. A :class:`SignalFlag`
    is always the first source. ``on_notice="continue"``: a notice snapshots once and training
    goes on until a signal; ``"exit"``: a notice preempts like a signal."""

    def __init__(
        self, config: ControllerSettings, sources: Sequence[PreemptionSource] = (), *, on_notice: str = "exit"
    ) -> None:
        self.config = config
        self.on_notice = on_notice
        self.notice_snapshot_taken = False
        self.signal_after_notice = False
        self.signal_flag = SignalFlag(config.signums)
        self.sources: list[PreemptionSource] = [self.signal_flag, *sources]
        self.schedule = AgreementSchedule(config.agree_every_n_steps, AGREE_INTERVAL_S, config.overlap_agreement)
        self.timeline: list[tuple[str, float]] = []
        self.notice: Notice | None = None
        self._warned_requeue_off = False
        self.preempted = False  # the emergency sequence ran (the exit is under way)
        self._requeued = False  # ... and the SLURM job is requeued (by this rank or another)

    # ---- sources ----------------------------------------------------------------------
    def bind(self, group: ProcessGroup | None) -> None:
        """Agree on ``group`` (a gloo group of the controller's own)."""
        self.schedule.bind(group)

    def start(self) -> None:
        """Start (or re-arm) every source; main thread."""
        hand_back()  # training (again, any trainer's): the signals are a preemption's again
        for source in self.sources:
            source.start()
        job = os.environ.get("SLURM_JOB_ID")
        if self.config.requeue is False and job is not None and not self._warned_requeue_off:
            self._warned_requeue_off = True
            log.warning(
                "lightning_preempt: requeue=False under SLURM (job %s): after a preemption this job exits "
                "with %d before the partition's GraceTime ends, and SLURM records that as FAILED "
                "(NonZeroExitCode) and does not requeue it, even with PreemptMode=REQUEUE and --requeue "
                "(measured with SLURM 22.05).\nHINT: leave requeue=None (rank 0 requeues the job after "
                "its snapshot); under `python -m lightning_preempt.torchrun` the reclaimed node's agent "
                "requeues its own job.", job, self.config.exit_code)

    def stop(self) -> None:
        for source in self.sources:
            try:
                source.stop()
            except Exception as err:  # one broken source must not keep the others running
                log.warning("lightning_preempt: stopping preemption source %s failed: %s", source.name, err)
        if self.preempted and self._requeued:
            # the teardown still takes seconds; SLURM's SIGTERM after a requeue can come that
            # late and would kill this rank: only note it. No requeue, nothing expected
            take_over(self.config.signums, _noted)

    def after_training(self, *, leader: bool, safe_step: Callable[[], str]) -> None:
        """After :meth:`stop`: a configured signal still at its default action now exits with
        ``exit_code`` (and requeues) instead of killing the process; nothing more is saved."""

        def exit_now(signum: signal.Signals) -> NoReturn:
            code = self.config.exit_code
            job = self._requeue_job() if leader else None
            then = f"; requeueing SLURM job {job} last" if job is not None else ""
            log.warning("lightning_preempt: [preemption] %s after training ended; exiting with code %d; safe to "
                        "resume from: %s%s", signum.name, code, safe_step(), then)  # fmt: skip
            if job is not None:
                log.warning("lightning_preempt: [preemption] %s", requeue_slurm(
                    job, REQUEUE_TIMEOUT_S, flush=flush_logs, settle_s=_SETTLE_S))  # fmt: skip
            flush_logs()
            raise quick_exit.armed(Preempted(code), code, flush_logs)

        if not self.preempted:  # (else the exit with exit_code is under way)
            take_over(self.config.signums, exit_now)

    def local_notice(self) -> Notice | None:
        """The earliest notice any local source has seen (cheap: reads fields); an advisory
        one (no deadline) is replaced when its source makes it definite."""
        if self.notice is None or self.notice.deadline is None:
            for source in self.sources:
                try:
                    notice = source.poll()
                except Exception as err:
                    log.warning("lightning_preempt: preemption source %s failed: %s", source.name, err)
                    continue
                if notice is None or notice == self.notice:
                    continue
                if self.notice is None or notice.received_at < self.notice.received_at:
                    self.notice = notice
                elif notice.source == self.notice.source and notice.deadline is not None:
                    self.notice = notice  # e.g. AWS: a rebalance recommendation, then the interruption
                    self.notice_snapshot_taken = False  # on_notice="continue": snapshot again
        return self.notice

    def _wants(self) -> tuple[bool, bool]:
        """This rank's ``(preempt now, snapshot now)``: a signal preempts; so does a notice
        unless ``on_notice="continue"``, where it asks for one snapshot (agreed like a due save)."""
        notice = self.local_notice()
        if notice is None:
            return False, False
        if self.signal_flag.is_set and not notice.source.startswith("SIG"):
            if not self.signal_after_notice:  # on_notice="continue": now the signal ends it
                self.signal_after_notice = True
                self.mark(f"{getattr(self.signal_flag.received, 'name', 'a signal')} after the {notice.source} notice")
            return True, False
        if self.signal_flag.is_set or self.on_notice != "continue":
            return True, False
        return False, not self.notice_snapshot_taken

    # ---- agreement ----------------------------------------------------------------------
    def at_boundary(self, now: float, *, save_due: bool, stop: bool, tier0: int = 0) -> Decision:
        """At an optimizer-step boundary (every rank): what all ranks do now. ``tier0``: this
        rank's vote for a tier-0 copy (preemption/schedule.py ``AgreementSchedule.tier0``)."""
        preempt_here, snapshot_here = self._wants()
        preempt, due, halt = self.schedule.at_boundary(now, preempt_here, save_due or snapshot_here, stop, tier0,
                                                       signal_age_s=self._signal_age(now, preempt_here))  # fmt: skip
        noticed = due and snapshot_here and not preempt
        if noticed:
            self.notice_snapshot_taken = True  # every rank saves this boundary: asked for once
        return Decision(preempt=preempt, save_due=due, stop=halt, notice_snapshot=noticed,
                        tier0=self.schedule.tier0)  # fmt: skip

    def now(self, *, stop: bool = False) -> Decision:
        """Agree synchronously (validation, start-up)."""
        preempt_here = self._wants()[0]
        if not self.schedule.bound:
            return Decision(preempt=preempt_here, stop=stop)
        age = self._signal_age(time.monotonic(), preempt_here)
        preempt, halt = self.schedule.now(preempt_here, stop, signal_age_s=age)
        return Decision(preempt=preempt, stop=halt)

    def _signal_age(self, now: float, preempting: bool) -> float:
        """Seconds since what makes this rank preempt came: the signal, else the notice."""
        if not preempting:
            return 0.0
        came = self.signal_flag.received_at if self.signal_flag.received_at is not None else self.origin
        return max(0.0, now - came) if came is not None else 0.0

    @property
    def agreed_after(self) -> tuple[int | None, float | None]:
        """From the first signal (on any rank) to the step the ranks agreed to preempt at:
        ``(steps, seconds)``, ``None`` where unknown (docs/design.md, "Agreement cost and latency")."""
        return self.schedule.signal_steps, self.schedule.signal_s

    def flush(self) -> None:
        self.schedule.flush()

    # ---- time ------------------------------------------------------------------------
    @property
    def origin(self) -> float | None:
        """When this process learnt of the preemption (monotonic), if it did."""
        return self.notice.received_at if self.notice is not None else None

    def deadline(self) -> float:
        """Monotonic time by which the process must be gone: the notice's deadline when it
        gives one, else the signal (or now) plus the grace period."""
        origin = self.origin if self.origin is not None else time.monotonic()
        by_grace = origin + self.config.grace_period_s
        signalled = self.signal_flag.received_at
        if signalled is not None and self.notice is not None and not self.notice.source.startswith("SIG"):
            # A signal after a cloud notice (on_notice="continue"): its grace period is what
            # is left, unless the notice's deadline (still ahead) is earlier.
            by_signal = signalled + self.config.grace_period_s
            ahead = self.notice.deadline if self.notice.deadline is not None and self.notice.deadline > signalled else None
            return min(by_signal, ahead) if ahead is not None else by_signal
        if self.notice is not None and self.notice.deadline is not None:
            return min(self.notice.deadline, by_grace) if self.notice.source.startswith("SIG") else self.notice.deadline
        return by_grace

    def budget(self) -> float:
        """Seconds left before the deadline, less the safety margin (>= 0)."""
        return max(0.0, self.deadline() - grace_margin(self.config.grace_period_s) - time.monotonic())

    def mark(self, event: str) -> None:
        now = time.monotonic()
        self.timeline.append((event, now))
        origin = self.origin
        since = f"{now - origin:.3f}s after the notice" if origin is not None else "no local notice"
        notice = self.notice
        if notice is not None and not notice.source.startswith("SIG"):  # a cloud notice: count down
            signalled = self.signal_flag.received_at is not None
            if notice.deadline is not None or signalled:
                end = "the signal's grace period ends" if signalled else f"the {notice.source} deadline"
                since += f", {self.deadline() - now:.1f}s before {end}"
        log.warning("lightning_preempt: [preemption] %s (%s)", event, since)

    # ---- the emergency sequence ------------------------------------------------------
    def emergency(
        self,
        step: int,
        *,
        snapshot: Callable[[], None],
        drain: Callable[[float], str],
        safe_step: Callable[[], str],
        leader: bool,
    ) -> NoReturn:
        """Snapshot, drain, requeue and exit: the exit happens whatever the others do.
        ``leader`` (global rank 0) requeues."""
        self.preempted = True
        steps, seconds = self.agreed_after
        after = f", {steps} step(s) and {seconds:.2f}s after the first signal" if steps and seconds is not None else ""
        self.mark(f"ranks agreed to preempt at step {step}{after}")
        self.flush()
        try:
            snapshot()
        except BaseException as err:
            if isinstance(err, KeyboardInterrupt):
                raise
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            self.mark(f"the snapshot of step {step} FAILED ({type(err).__name__}: {first}); exiting anyway")
        held = ""
        try:
            held = drain(self.budget())
        except Exception as err:
            self.mark(f"the drain failed ({err}); exiting anyway")
        requeued = self._requeue_job()
        self._requeued = requeued is not None
        job = requeued if leader else None
        then = f"; requeueing SLURM job {job} last (SLURM then ends this run at once)" if job is not None else ""
        self.mark(f"exiting with code {self.config.exit_code}; safe to resume from: {safe_step()}{held}{then}")
        if job is None and requeued is not None:
            # another rank requeues: absorb SLURM's SIGTERM too, or the job is recorded FAILED
            self.mark(absorb_requeue_term(requeued, min(_SETTLE_S, self.budget()), flush=flush_logs))
        if job is not None:
            # the last act: SLURM's kill follows `scontrol requeue` within milliseconds
            self.mark(requeue_slurm(job, max(1.0, min(REQUEUE_TIMEOUT_S, self.budget())),
                                    flush=flush_logs, settle_s=min(_SETTLE_S, self.budget())))  # fmt: skip
        raise quick_exit.armed(Preempted(self.config.exit_code), self.config.exit_code, flush_logs)

    def _requeue_job(self) -> str | None:
        """The SLURM job this rank requeues, if it should (``requeue=None``: under SLURM)."""
        job = os.environ.get("SLURM_JOB_ID")
        if self.config.requeue is None and os.environ.get(AGENT_REQUEUES) == "1":
            return None  # lightning_preempt.torchrun's agent requeues the reclaimed node's job
        wanted = self.config.requeue if self.config.requeue is not None else job is not None
        if not wanted:
            return None
        if job is None:
            log.warning("lightning_preempt: requeue=True but SLURM_JOB_ID is not set; not requeueing")
        return job


#: How long to wait for (and absorb) SLURM's SIGTERM after a requeue (SIGKILL: ``KillWait`` later).
_SETTLE_S = 3.0


def flush_logs() -> None:
    """Flush every logging handler and the standard streams (before SLURM's kill)."""
    for logger in (log, logging.getLogger("lightning_preempt"), logging.getLogger()):
        for handler in logger.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
