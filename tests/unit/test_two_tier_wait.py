"""TwoTier.wait with a deadline beyond what a lock can wait (a notice's far deadline, a huge
grace period) still waits for the drain, instead of the OverflowError cancelling it."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

from lightning_preempt.tiers.two_tier import TwoTier


def test_wait_with_a_deadline_past_timeout_max_waits_for_the_drain(tmp_path: Path) -> None:
    tiers = TwoTier(str(tmp_path / "local"), {})
    fut: Future[str] = Future()
    tiers._futures.append(fut)
    threading.Timer(0.2, fut.set_result, args=("committed",)).start()
    assert tiers.wait(timeout_s=threading.TIMEOUT_MAX * 1e6) is True
    assert fut.result() == "committed"
    assert not tiers._cancel.is_set()
