"""Issue 32: a rank that does not requeue absorbs the SIGTERM SLURM sends every task after the
requeue (before, only rank 0 did, and rank 1 died of it in its teardown)."""

from __future__ import annotations

import os
import signal
import threading

from lightning_preempt.preemption.requeue import absorb_requeue_term


def test_a_non_leader_rank_absorbs_slurms_sigterm_and_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    said = absorb_requeue_term("1", 5.0)  # the process is alive after the SIGTERM: absorbed
    timer.join()
    assert "absorbed on this rank too" in said, said
    assert signal.getsignal(signal.SIGTERM) == before


def test_without_a_sigterm_it_waits_no_longer_than_settle() -> None:
    said = absorb_requeue_term("1", 0.1)
    assert said == "no SIGTERM from SLURM within 0.1s on this rank" or "ending for good" in said, said
