"""A survivor waiting for the heartbeats' verdict after a collective's error (engine/failures.py)
outlives the launcher's SIGTERM: when the lost node hosted the c10d store, the survivors'
agents SIGTERM their workers at once, before the verdict, and a worker that died then left
no failure record (the multi-host test: tests/multihost/test_node_loss.py, node 0 lost)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from lightning_preempt.collective.heartbeat import Verdict
from lightning_preempt.engine.failures import FailureDetector


class _Heartbeat:
    """Stands in for the mesh: SIGTERM arrives during the wait, then the verdict (or none)."""

    watching = True

    def __init__(self, detector: FailureDetector, verdict: Verdict | None) -> None:
        self.detector, self.verdict = detector, verdict
        self.alive_after_sigterm = False

    def wait_verdict(self, timeout_s: float) -> Verdict | None:
        os.kill(os.getpid(), signal.SIGTERM)  # the agent tearing its worker down
        self.alive_after_sigterm = True  # a default handler would have ended the process here
        if self.verdict is not None:
            threading.Thread(target=self.detector._act, args=(self.verdict,)).start()
        return self.verdict


def _verdict() -> Verdict:
    return Verdict(rank=1, world=2, survivors=(1,), lost=(0,), agreed_step=10, quorum=False, agreed=True,
                   silent_s=4.0, detected_t=0.0, decided_t=0.0)  # fmt: skip


def _detector(verdict: Verdict | None) -> tuple[FailureDetector, _Heartbeat, list[Any]]:
    events: list[Any] = []
    detector = FailureDetector(timeout_s=1.0, exit_code=75, held=lambda: [10], record=lambda v: events.append("record"),
                               exit=lambda code: events.append(("exit", code)))  # fmt: skip
    hb = _Heartbeat(detector, verdict)
    detector.heartbeat = hb  # type: ignore[assignment]
    return detector, hb, events


def test_a_sigterm_during_the_verdict_wait_waits_for_the_record_and_the_exit() -> None:
    detector, hb, events = _detector(_verdict())
    previous = signal.signal(signal.SIGTERM, lambda *a: events.append("sigterm"))
    try:
        detector.after_error(RuntimeError("Connection closed by peer"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert hb.alive_after_sigterm
    # the record first, then the verdict's exit, and only then the held SIGTERM (to the old handler)
    assert events == ["record", ("exit", 75), "sigterm"], events


def test_a_held_sigterm_is_acted_on_when_no_verdict_comes() -> None:
    detector, hb, events = _detector(None)
    previous = signal.signal(signal.SIGTERM, lambda *a: events.append("sigterm"))
    try:
        detector.after_error(RuntimeError("Connection closed by peer"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert hb.alive_after_sigterm and events == ["sigterm"]
