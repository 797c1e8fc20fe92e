"""Tier 0's loss bound (engine/loss_bound.py, engine/memory_tier.py, Engine.step_end):
training never runs more than ``bound`` steps past the newest copy every node holds."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from lightning_preempt.engine import memory_tier
from lightning_preempt.engine.loss_bound import (
    FAILED,
    HELD,
    RUNNING,
    Copy,
    LossBound,
    auto_bound,
    fixed_bound,
    read_schedule,
    write_schedule,
)
from lightning_preempt.save.history import SaveRecord
from lightning_preempt.tiers.tier0 import WARMUP_STEPS, AutoEvery


def _record(step: int, *, committed: bool = False) -> SaveRecord:
    rec = SaveRecord(f"/x/step-{step}", step, time.perf_counter())
    if committed:
        rec.committed_s = 0.1
    return rec


def test_a_copy_is_held_only_once_committed_and_what_follows_it_succeeded() -> None:
    rec = _record(4)
    follow: Future[bool | None] = Future()
    copy = Copy(4, rec, [follow])
    assert copy.status() == RUNNING
    rec.committed_s = 0.2
    assert copy.status() == RUNNING  # the peer copy still runs
    follow.set_result(False)  # the peer copy failed: on one node only
    assert copy.status() == FAILED
    done: Future[bool | None] = Future()
    done.set_result(None)  # a seal and retention (one node)
    assert Copy(4, _record(4, committed=True), [done]).status() == HELD
    assert Copy(4, None).status() == HELD  # this rank wrote nothing: another rank's record decides
    broken = _record(4)
    broken.error = OSError("full")
    assert Copy(4, broken).status() == FAILED


def test_the_anchor_moves_only_to_copies_every_rank_holds_in_order() -> None:
    bound = LossBound()
    bound.resumed(10)
    bound.bound = 6
    for step in (12, 14, 16):
        bound.started(Copy(step, None))
    # rank 1 still writes 14: 12 moves the anchor, 14 and 16 wait (order kept)
    assert bound.confirm([[HELD, HELD, HELD], [HELD, RUNNING, HELD]]) == []
    assert bound.anchor == 12 and [c.step for c in bound.pending] == [14, 16]
    assert bound.confirm([[HELD, HELD], [FAILED, HELD]]) == [14]  # failed on rank 1: dropped
    assert bound.anchor == 16 and bound.pending == []
    assert not bound.over(21) and bound.over(22)


def test_at_the_bound_training_waits_for_the_oldest_copy_that_is_new_enough() -> None:
    bound = LossBound()
    bound.resumed(0)
    bound.bound = 4
    bound.started(Copy(2, None))
    bound.started(Copy(4, None))
    assert [c.step for c in bound.waiting_for(4)] == [2]  # 2 brings the anchor within 4 of step 4
    assert [c.step for c in bound.waiting_for(6)] == [2, 4]  # 2 would not: wait for 4 too
    assert [c.step for c in bound.waiting_for(9)] == [2, 4]  # neither: all, then a new copy
    assert not LossBound().over(10**6)  # no bound known yet: nothing is waited for


def test_the_bounds_a_fixed_k_and_auto_promise() -> None:
    assert fixed_bound(5) == 10
    assert auto_bound(every=20, copy_steps=3, agree_steps=2) == 25
    assert auto_bound(every=0, copy_steps=0, agree_steps=-1) == 2


def test_a_schedule_left_by_a_launch_is_read_back_and_a_bad_one_ignored(tmp_path: Path) -> None:
    assert read_schedule(str(tmp_path)) is None
    write_schedule(str(tmp_path), 12, 3)
    assert read_schedule(str(tmp_path)) == {"every": 12, "copy_steps": 3}
    assert [p.name for p in tmp_path.iterdir()] == [".lp-tier0-schedule.json"]  # no temporary left
    (tmp_path / ".lp-tier0-schedule.json").write_text('{"every": 0, "copy_steps": 3}')
    assert read_schedule(str(tmp_path)) is None
    (tmp_path / ".lp-tier0-schedule.json").write_text("{not json")
    assert read_schedule(str(tmp_path)) is None
    write_schedule(str(tmp_path / "missing"), 1, 1)  # best effort: never raises


def test_a_carried_schedule_survives_the_first_copy_of_a_launch() -> None:
    auto = AutoEvery()
    auto.resume(every=30, copy_steps=4)
    for i in range(WARMUP_STEPS + 1):
        auto.boundary(float(i))
    assert auto.ready(WARMUP_STEPS)  # the first copy is due once the base step time is known
    auto.started(WARMUP_STEPS)
    auto.boundary(WARMUP_STEPS + 1.0)
    assert auto.finished(blocking_s=0.5, copy_s=9.0) == 30  # set-up, not a measurement: kept
    assert auto.copy_steps == 4


class _Saver:
    """The saver's two calls MemoryTier makes (submit, history) on a real thread."""

    def __init__(self) -> None:
        self.history: list[SaveRecord] = []
        self.jobs: list[Future[bool | None]] = []

    def submit(self, fn: object) -> Future[bool | None]:
        fut: Future[bool | None] = Future()
        self.jobs.append(fut)
        fut.set_result(fn())  # type: ignore[operator]
        return fut


def _tier(tmp_path: Path, every: int | str) -> memory_tier.MemoryTier:
    tier = memory_tier.MemoryTier(str(tmp_path / "t0"), every)  # type: ignore[arg-type]
    assert tier.setup(None, leader=True)
    return tier


def test_settle_blocks_until_the_copy_in_flight_commits(tmp_path: Path) -> None:
    """Fixed K = 2 (bound 4): the copy of step 2 still runs at step 4; settle returns only
    once it committed, and then the bound holds again."""
    tier = _tier(tmp_path, 2)
    tier.resumed(0)
    assert tier.loss.bound == 4 and not tier.over(3) and tier.over(4)
    rec = _record(2)
    tier.started(2, str(tmp_path / "t0" / "step-2"), rec)
    threading.Timer(0.3, lambda: setattr(rec, "committed_s", 0.3)).start()
    t0 = time.perf_counter()
    assert tier.settle(4, None)
    assert time.perf_counter() - t0 >= 0.25 and tier.loss.anchor == 2 and tier.held_s >= 0.25
    assert not tier.over(5) and tier.over(6)


def test_settle_says_a_new_copy_is_needed_when_none_is_new_enough(tmp_path: Path) -> None:
    tier = _tier(tmp_path, 2)
    tier.resumed(0)
    bad = _record(2)
    bad.error = OSError("no space left on device")
    tier.started(2, str(tmp_path / "t0" / "step-2"), bad)
    assert not tier.settle(4, None)  # 2 failed: the anchor stays at 0
    assert tier.loss.anchor == 0 and tier.over(4)
    tier.give_up(4)
    assert tier.loss.anchor == 4 and not tier.over(7)


def test_the_path_gather_moves_the_anchor_and_agrees_on_the_bound(tmp_path: Path) -> None:
    tier = _tier(tmp_path, "auto")
    tier.resumed(0)
    assert tier.loss.bound is None  # auto: nothing measured, nothing carried
    assert tier.auto is not None
    tier.auto.every, tier.auto.copy_steps = 8, 2
    tier.agree_steps = lambda: 3
    tier.started(6, str(tmp_path / "t0" / "step-6"), _record(6, committed=True))
    path = tier.path(14, None)
    assert path is not None and path.endswith("step-0000000014")
    assert tier.loss.anchor == 6 and tier.loss.bound == 13  # 8 + 2 + 3
    assert read_schedule(str(tmp_path / "t0")) == {"every": 8, "copy_steps": 2}  # for the next launch
    again = memory_tier.MemoryTier(str(tmp_path / "t0"), "auto")
    assert again.setup(None, leader=True, agree_steps=lambda: 3)
    assert again.loss.bound == 13 and again.auto is not None and again.auto.every == 8


def test_the_engine_waits_at_the_bound_and_copies_when_no_copy_is_new_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine.step_end with a fixed K whose copies are skipped: at the bound it makes a copy
    itself and waits for it (never more than 2 K steps past a held copy)."""
    from lightning_preempt.engine.engine import Engine

    engine = Engine.__new__(Engine)
    tier = _tier(tmp_path, 3)
    tier.resumed(0)
    made: list[int] = []

    def save_memory(step: int, *, at_bound: bool = False) -> None:
        made.append(step)
        tier.started(step, str(tmp_path / "t0" / f"step-{step}"), _record(step, committed=True))

    engine.memory = tier
    monkeypatch.setattr(engine, "save_memory", save_memory, raising=False)
    monkeypatch.setattr(Engine, "_group", property(lambda self: None))
    for step in range(1, 6):
        assert not tier.over(step)
    engine._hold_at_bound(6)
    assert made == [6] and tier.loss.anchor == 6 and not tier.over(11) and tier.over(12)
