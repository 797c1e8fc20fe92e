"""Tier 0's policy pieces (tiers/tier0.py): K from measured times, the schedule, retention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_preempt.catalog.retention import apply_retention
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name
from lightning_preempt.tiers.tier0 import (
    WARMUP_STEPS,
    AutoEvery,
    choose_every,
    committed_steps,
    tier0_root,
)


def test_k_keeps_the_overhead_within_one_percent() -> None:
    assert choose_every(0.05, 0.1) == 50  # 0.05 s copy over 50 steps of 0.1 s: exactly 1 %
    assert choose_every(0.051, 0.1) == 51
    assert choose_every(0.0, 0.1) == 1
    k = choose_every(0.3, 0.25)
    assert 0.3 / (k * 0.25) <= 0.01
    with pytest.raises(ValueError, match="HINT"):
        choose_every(0.1, 0.0)


def _steps(auto: AutoEvery, times: list[float], t0: float = 0.0, *, other_save: bool = False) -> float:
    """Feed boundaries ``times`` apart after ``t0``; returns the last boundary's time."""
    t = t0
    for gap in times:
        t += gap
        auto.boundary(t, other_save=other_save)
    return t


def _warm(auto: AutoEvery, step_s: float = 0.1) -> float:
    """Measure the base step time and finish the first copy (set-up, not a measurement)."""
    t = _steps(auto, [step_s] * 11)
    auto.started(10)
    t = _steps(auto, [step_s * 5], t0=t)  # the first copy allocated its buffers: slow
    assert auto.finished(blocking_s=step_s * 4, copy_s=step_s * 2.5) == 3  # its duration only: 2.5 steps
    return t


def test_auto_waits_for_the_base_step_time_then_copies_once_to_measure() -> None:
    auto = AutoEvery()
    assert not auto.ready(0)
    _steps(auto, [0.1] * WARMUP_STEPS)  # the first boundary has no gap: one more step measured below
    assert auto.step_s is None and not auto.ready(WARMUP_STEPS)
    _steps(auto, [0.1], t0=0.1 * WARMUP_STEPS)
    assert auto.step_s == pytest.approx(0.1) and auto.ready(WARMUP_STEPS + 1)
    auto.started(WARMUP_STEPS + 1)
    assert not auto.ready(WARMUP_STEPS + 500)  # never while the copy is in flight


def test_auto_k_counts_the_excess_step_time_the_copy_caused_not_only_its_blocking() -> None:
    auto = AutoEvery()
    t = _warm(auto)
    auto.started(10)
    # the copy blocked 0.02 s, and while it was written two steps ran 0.01 s slower: 0.04 s in all
    t = _steps(auto, [0.12, 0.11, 0.11], t0=t)
    k = auto.finished(blocking_s=0.02, copy_s=0.25)
    assert k == choose_every(0.04, 0.1) == 40
    assert 0.04 / (k * 0.1) <= 0.01  # within 1 % of the K steps
    assert not auto.ready(10 + k - 1) and auto.ready(10 + k)


def test_auto_k_is_never_shorter_than_the_whole_copy() -> None:
    auto = AutoEvery()
    t = _warm(auto)
    auto.started(10)
    _steps(auto, [0.1], t0=t)  # no excess at all (a GPU step does not feel the CPU writer)
    assert auto.finished(blocking_s=0.0, copy_s=3.0) == 30  # 3 s of copy = 30 steps of 0.1 s


def test_auto_k_follows_new_measurements_through_a_median() -> None:
    auto = AutoEvery()
    t = _warm(auto)
    ks = []
    for i, blocking in enumerate([0.02, 0.02, 0.5, 0.04, 0.04, 0.04]):
        auto.started(i)
        t = _steps(auto, [0.1], t0=t)
        ks.append(auto.finished(blocking_s=blocking, copy_s=0.0))
    assert ks[0] == 20 and ks[2] == 20  # one noisy copy moves nothing
    assert ks[-1] == 40  # the copies became slower: K follows


def test_a_window_another_save_overlapped_counts_only_the_blocking() -> None:
    auto = AutoEvery()
    t = _warm(auto)
    auto.started(10)
    t = _steps(auto, [0.9], t0=t, other_save=True)  # a disk save's cost, not tier 0's
    assert auto.finished(blocking_s=0.01, copy_s=0.0) == 10
    _steps(auto, [5.0], t0=t, other_save=True)
    assert auto.step_s == pytest.approx(0.1)  # a save's step is not a base step


def test_auto_rejects_a_bad_overhead() -> None:
    with pytest.raises(ValueError, match="HINT"):
        AutoEvery(max_overhead=0)


def test_root_is_one_directory_per_run() -> None:
    assert tier0_root("abc123", "/dev/shm/lp/") == "/dev/shm/lp/abc123"
    with pytest.raises(ValueError, match="HINT"):
        tier0_root("../etc")


def _ckpt(root: Path, step: int, committed: bool) -> Path:
    d = root / checkpoint_name(step)
    d.mkdir(parents=True)
    if committed:
        (d / MANIFEST_NAME).write_bytes(Manifest(step=step, epoch=0, world_size=1, files={}).to_json())
    return d


def test_retention_keeps_the_newest_two_and_drops_torn_copies(tmp_path: Path) -> None:
    paths = {s: _ckpt(tmp_path, s, committed=s != 30) for s in (10, 20, 30, 40, 50, 60)}
    torn_newest = _ckpt(tmp_path, 70, committed=False)  # a copy in flight: not ours to touch yet
    assert committed_steps(str(tmp_path)) == [10, 20, 40, 50, 60]
    pruned = {Path(p).name for p in apply_retention(str(tmp_path), 2)}
    assert pruned == {paths[s].name for s in (10, 20, 30, 40)}
    assert torn_newest.name not in pruned
    assert apply_retention(str(tmp_path / "absent"), 1) == []


def test_the_default_memory_root_is_stable_per_dirpath_and_names_a_directory() -> None:
    from lightning_preempt.tiers.tier0 import default_memory_root

    a = default_memory_root("gs://bucket/run-7/")
    assert a == default_memory_root("gs://bucket/run-7")  # the same on every restart
    base = f"/dev/shm/lightning_preempt-{os.geteuid()}/"  # each user's own base (docs/security.md)
    assert a.startswith(base + "run-7-") and "/" not in a[len(base) :]
    assert default_memory_root("gs://other/run-7") != a  # two jobs, one name: two directories


def test_tier0_options_are_validated_and_default_to_dev_shm() -> None:
    from lightning_preempt.engine.config import PreemptionConfig
    from lightning_preempt.engine.ledger_writer import start_fields

    config = PreemptionConfig(dirpath="ckpts/run", tier0_every_n_steps=4)
    assert config.memory_dirpath is not None and config.memory_dirpath.startswith(
        f"/dev/shm/lightning_preempt-{os.geteuid()}/run-"
    )
    assert PreemptionConfig(dirpath="ckpts/run").memory_dirpath is None  # no tier 0, no directory
    with pytest.raises(ValueError, match=r"(?s)tier0_every_n_steps must be an int >= 1.*HINT: .*'auto'"):
        PreemptionConfig(dirpath="ckpts/run", tier0_every_n_steps=0)
    auto = PreemptionConfig(dirpath="ckpts/run", tier0_every_n_steps="auto")
    assert auto.memory_dirpath == config.memory_dirpath
    given = PreemptionConfig(dirpath="ckpts/run", tier0_every_n_steps="auto", memory_dirpath="/dev/shm/x")
    assert given.tier0_every_n_steps == "auto" and given.memory_dirpath == "/dev/shm/x"
    with pytest.raises(ValueError, match="HINT: tier 0 is on when tier0_every_n_steps is set"):
        PreemptionConfig(dirpath="ckpts/run", memory_dirpath="/dev/shm/x")  # a directory alone: say so
    with pytest.raises(ValueError, match="memory_dirpath must be a local directory"):
        PreemptionConfig(dirpath="ckpts/run", tier0_every_n_steps=4, memory_dirpath="s3://b/x")
    fields = start_fields(
        8, config.memory_dirpath + "/step-0000000008", 1, config, memory_dirpath=config.memory_dirpath
    )
    assert fields["resumed_tier"] == "memory"
    assert (
        start_fields(5, "ckpts/run/step-0000000005", 1, config, memory_dirpath=config.memory_dirpath)["resumed_tier"]
        == "dirpath"
    )


def test_a_vote_cast_before_the_last_copy_started_starts_nothing(tmp_path: Path) -> None:
    """Overlapped agreement reads an exchange one boundary later: the votes in it were cast
    before the copy that started meanwhile, so "every rank ready" there is stale (it would
    start a second copy at once, behind the first). The votes carry the copy count."""
    from lightning_preempt.engine.memory_tier import MemoryTier

    tier = MemoryTier(str(tmp_path), "auto")
    tier.enabled = True
    assert tier.agreed(1) and not tier.agreed(2) and not tier.agreed(0)  # 0: no exchange here
    tier.started(10, str(tmp_path / "step-10"), None)
    assert not tier.agreed(1)  # cast before the copy of step 10
    assert tier.agreed(3 * 1 + 1) and not tier.agreed(3 * 1 + 2)
    assert not MemoryTier(str(tmp_path), 4).agreed(1)  # a fixed K never votes


def test_auto_counts_what_follows_a_copy_on_the_job_thread_in_its_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seal reads a committed copy back (and several nodes' peer copy sends it) on the job
    thread: the copy's window stays open, and the next copy is not voted for, until that is
    done; its duration counts in the copy's (K >= the whole copy in steps)."""
    import types
    from concurrent.futures import Future

    from lightning_preempt.engine import memory_tier
    from lightning_preempt.save.history import SaveRecord

    clock = [0.0]
    monkeypatch.setattr(
        memory_tier, "time", types.SimpleNamespace(monotonic=lambda: clock[0], perf_counter=lambda: clock[0])
    )
    jobs: list[tuple[object, Future[None]]] = []

    class Saver:
        history: list[SaveRecord] = []

        def submit(self, fn: object) -> Future[None]:
            jobs.append((fn, Future()))
            return jobs[-1][1]

    tier, saver = memory_tier.MemoryTier(str(tmp_path), "auto"), Saver()
    tier.enabled = True
    for step in range(WARMUP_STEPS + 1):  # 1 s quiet steps
        clock[0] = float(step)
        vote = tier.vote(step, saver)  # type: ignore[arg-type]
    assert tier.agreed(vote)
    rec = SaveRecord(str(tmp_path / "step-6"), 6, clock[0])
    saver.history.append(rec)
    tier.started(6, rec.path, rec)
    tier.after_copy(saver, rec.path, None, leader=True)  # type: ignore[arg-type]
    rec.blocking_s, rec.committed_s = 0.1, 0.5  # committed half a step later...
    for step in (7, 8):
        clock[0] = float(step)
        assert not tier.agreed(tier.vote(step, saver))  # type: ignore[arg-type]
        assert tier.auto is not None and tier.auto.in_flight and tier.every is None  # ...the seal still runs
    clock[0] = 9.0
    fn, fut = jobs[0]
    fn()  # type: ignore[operator]
    fut.set_result(None)
    tier.vote(9, saver)  # type: ignore[arg-type]
    assert tier.every == 4  # the whole copy in steps: committed at 5.5, the seal done at 9.0 (started at 5.0)
