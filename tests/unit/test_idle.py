"""A periodic save's write starts once the training thread waits (save/idle.py): the thread's
CPU clock tells a waiting thread from a working one, and the saver's queued write follows it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.save import idle
from lightning_preempt.save.history import SaveRecord
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage.store import Store

pytestmark = pytest.mark.skipif(idle.Gate.here([]).clock is None, reason="threads have no CPU clock here")


def _waiting_thread() -> tuple[threading.Thread, int | None, threading.Event]:
    """A thread that waits until the returned event is set, and its CPU clock."""
    clocks: list[int | None] = []
    ready, stop = threading.Event(), threading.Event()

    def run() -> None:
        clocks.append(idle.Gate.here([]).clock)
        ready.set()
        stop.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait()
    return thread, clocks[0], stop


class _FakeClock:
    """A training thread's CPU clock that runs while :attr:`busy` (one window a reading)."""

    clock = 12345

    def __init__(self, busy: bool) -> None:
        self.busy = busy
        self._now = 0.0

    def read(self, clock: int) -> float:
        assert clock == self.clock
        if self.busy:
            self._now += idle.WINDOW_S
        return self._now


def test_a_waiting_thread_is_seen_waiting_and_a_working_one_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeper, clock, stop = _waiting_thread()
    assert idle.wait_until_idle(clock, limit_s=30.0)  # seen waiting long before the limit
    stop.set()
    sleeper.join()
    # ended: its clock fails (False) or, until the kernel lets the thread go, stands still (True)
    assert idle.wait_until_idle(clock, limit_s=1.0) in (False, True)

    busy = _FakeClock(busy=True)  # a thread that never stops (a real spinner may be descheduled)
    started = time.monotonic()
    monkeypatch.setattr(idle, "_clock_gettime", busy.read)
    assert not idle.wait_until_idle(busy.clock, limit_s=0.2)
    assert time.monotonic() - started >= 0.2

    assert not idle.wait_until_idle(None) and not idle.wait_until_idle(clock, limit_s=0)


def test_a_write_waits_at_most_half_the_slack_the_save_before_left() -> None:
    """The next save must not find this one's write still running because it started late."""
    first = SaveRecord("a", 1, started=100.0, blocking_s=0.001, committed_s=0.031)  # a 30 ms write
    assert idle.Gate.here([first]).limit_s == idle.LIMIT_S  # the first save: the fixed limit
    soon = SaveRecord("b", 2, started=100.04)  # 40 ms later: 10 ms of slack
    assert idle.Gate.here([first, soon]).limit_s == pytest.approx(idle.SLACK_SHARE * 0.01)
    late = SaveRecord("c", 2, started=100.02)  # before that write ended: the writer is behind
    assert idle.Gate.here([first, late]).limit_s == 0.0
    assert idle.Gate.here([soon, late]).limit_s == 0.0  # the save before still writes (or failed)
    waited = SaveRecord("e", 3, started=100.04, waited_s=0.005)  # it waited for the buffers: behind
    assert idle.Gate.here([first, waited]).limit_s == 0.0
    apart = SaveRecord("d", 3, started=200.0)  # saves far apart: the fixed limit
    assert idle.Gate.here([first, apart]).limit_s == idle.LIMIT_S


def test_writes_stop_looking_where_training_never_waits_and_look_again_now_and_then() -> None:
    def records(misses_before: int | None) -> list[SaveRecord]:
        return [SaveRecord("a", 1, started=1.0, committed_s=0.01, idle_misses=misses_before),
                SaveRecord("b", 2, started=2.0)]  # fmt: skip

    looks = idle.Gate.here(records(1))  # one write in a row did not find training waiting
    assert looks.limit_s > 0 and looks.record is not None and looks.misses_before == 1
    history = records(idle.MISSES_OFF)  # two did: no look, and this one counts as not found
    skipped = idle.Gate.here(history)
    assert skipped.limit_s == 0 and skipped.record is None and history[-1].idle_misses == idle.MISSES_OFF + 1
    assert idle.Gate.here(records(idle.PROBE_EVERY)).limit_s > 0  # once in PROBE_EVERY saves: a look
    assert idle.Gate.here(records(5 * idle.PROBE_EVERY + 1)).limit_s == 0  # (past history's cap too)
    assert idle.Gate.here(records(None)).limit_s > 0  # after a save training waited for: a look


def _checkpoint(step: int) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((64,), float(step))}, "optimizer_states": [], "global_step": step}


def test_a_periodic_write_starts_only_once_the_training_thread_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idle, "LIMIT_S", 60.0)  # only the training thread's wait starts the write
    training = _FakeClock(busy=True)  # its CPU clock, as the gate reads it
    monkeypatch.setattr(idle.Gate, "here", staticmethod(lambda history: idle.Gate(training.clock, idle.LIMIT_S)))
    monkeypatch.setattr(idle, "_clock_gettime", training.read)
    started = threading.Event()
    real_write = Saver._write

    def write(self: Saver, *args: Any, **kwargs: Any) -> Any:
        started.set()
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Saver, "_write", write)
    saver = Saver({})
    url = str(tmp_path / "step-1")
    saver.save(_checkpoint(1), SaveOrder(url))
    assert not started.wait(0.3)  # training computes: its clock runs, the write waits
    training.busy = False  # training waits: the write starts and commits
    saver.wait()
    assert started.is_set()
    assert torch.equal(load_full_checkpoint(Store(url))["state_dict"]["w"], torch.full((64,), 1.0))

    started.clear()
    training.busy = True
    saver.save(_checkpoint(2), SaveOrder(str(tmp_path / "step-2")), wait=True)  # waited for: at once
    assert started.is_set()
    saver.close()
    assert load_full_checkpoint(Store(str(tmp_path / "step-2")))["global_step"] == 2
