"""Signals after training (preemption/signals.py, LateSignals): taken over only where the default
action stands, the first one acted on, later ones absorbed, handed back before training."""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

from lightning_preempt.preemption import signals

SIG = signal.SIGUSR2


def _deliver() -> None:
    os.kill(os.getpid(), SIG)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary


def test_the_first_signal_is_acted_on_later_ones_absorbed_then_handed_back() -> None:
    seen: list[signal.Signals] = []
    previous = signal.signal(SIG, signal.SIG_DFL)
    try:
        signals.take_over([SIG], seen.append)
        assert signal.getsignal(SIG) == signals.LATE._handle
        _deliver()
        _deliver()  # SLURM signals again after a requeue: the exit is under way
        assert seen == [SIG] and signals.LATE.later == 1
        signals.hand_back()  # training starts again
        assert signal.getsignal(SIG) == signal.SIG_DFL
    finally:
        signals.hand_back()
        signal.signal(SIG, previous)


def test_a_handler_of_the_users_is_left_alone() -> None:
    got: list[int] = []

    def users(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    previous = signal.signal(SIG, users)
    try:
        signals.take_over([SIG], lambda s: (_ for _ in ()).throw(AssertionError("took over")))
        assert signal.getsignal(SIG) is users
        _deliver()
        assert got == [SIG]
        signals.hand_back()
        assert signal.getsignal(SIG) is users
    finally:
        signals.hand_back()
        signal.signal(SIG, previous)


def test_after_a_preemption_a_signal_in_the_teardown_is_only_noted() -> None:
    """Issue 32 (CI): the teardown after the snapshot ran with the default action back, and
    SLURM's SIGTERM after another rank's requeue, late under load, killed rank 1 there."""
    from lightning_preempt.engine.config import PreemptionConfig
    from lightning_preempt.preemption.controller import PreemptionController

    previous = signal.signal(SIG, signal.SIG_DFL)
    try:
        ctl = PreemptionController(PreemptionConfig(dirpath="unused", signals=(SIG,), overlap_agreement=False))
        ctl.start()
        ctl.preempted = ctl._requeued = True  # the emergency sequence ran and the job is requeued
        ctl.stop()  # the sources put the default action back; the late handler takes over
        assert signal.getsignal(SIG) == signals.LATE._handle
        _deliver()  # would kill the process with the default action
        assert signals.LATE.fired == SIG
        ctl.start()  # training again (same process): the signal is a preemption's again
        assert signal.getsignal(SIG) != signals.LATE._handle
        ctl._requeued = False  # preempted without a requeue: no late SIGTERM is expected
        ctl.stop()
        assert signal.getsignal(SIG) == signal.SIG_DFL
    finally:
        signals.hand_back()
        signal.signal(SIG, previous)
