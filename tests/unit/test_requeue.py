"""Who requeues a SLURM job (preemption/requeue.py, the controller): the parts that need no
SLURM. The real scheduler's side is tests/e2e/test_slurm.py."""

from __future__ import annotations

import logging

import pytest

from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.preemption.controller import PreemptionController
from lightning_preempt.preemption.requeue import AGENT_REQUEUES, _seconds


def _controller(requeue: bool | None) -> PreemptionController:
    return PreemptionController(PreemptionConfig(dirpath="unused", requeue=requeue, overlap_agreement=False))


def test_requeue_false_under_slurm_says_what_it_costs_once(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    controller = _controller(False)
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
        try:
            controller.start()
            controller.start()  # a second fit of the same callback
        finally:
            controller.stop()
    warned = [r.getMessage() for r in caplog.records if "requeue=False under SLURM (job 77)" in r.getMessage()]
    assert len(warned) == 1
    assert "FAILED" in warned[0] and "\nHINT: leave requeue=None" in warned[0]
    assert controller._requeue_job() is None


def test_outside_slurm_requeue_false_is_silent(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    controller = _controller(False)
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
        controller.start()
        controller.stop()
    assert not [r for r in caplog.records if "requeue=False" in r.getMessage()]


def test_workers_under_the_torchrun_wrapper_leave_the_requeue_to_their_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert _controller(None)._requeue_job() == "77"  # a plain SLURM job: rank 0 requeues
    monkeypatch.setenv(AGENT_REQUEUES, "1")
    assert _controller(None)._requeue_job() is None  # the reclaimed node's agent does
    assert _controller(True)._requeue_job() == "77"  # an explicit True still wins


@pytest.mark.parametrize(("text", "seconds"), [("00:02:00", 120), ("1-00:00:01", 86401), ("05:00", 300),
                                               ("UNLIMITED", None), ("", None)])  # fmt: skip
def test_slurm_durations(text: str, seconds: int | None) -> None:
    assert _seconds(text) == seconds
