"""The checkpoint-interval math of ``lightning_preempt.plan`` (pure functions, no I/O)."""

from __future__ import annotations

import math

import pytest

from lightning_preempt.cli.plan import (
    PlanInputs,
    daly_interval,
    format_duration,
    lost_fraction,
    make_plan,
    parse_bandwidth,
    parse_duration,
    parse_size,
    young_interval,
)
from lightning_preempt.preemption.deadline import grace_margin


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.5GB", 1_500_000_000),
        ("840GiB", 840 * 2**30),
        ("2e9", 2_000_000_000),
        ("512", 512),
        ("64 MiB", 64 * 2**20),
        ("3tb", 3 * 10**12),
        ("10k", 10_000),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "1.5XB", "-3GB", "1,5GB"])
def test_parse_size_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot read a size"):
        parse_size(bad)


def test_parse_bandwidth() -> None:
    assert parse_bandwidth("2GB/s") == 2e9
    assert parse_bandwidth("800MiB/s") == 800 * 2**20
    assert parse_bandwidth("1.5GB") == 1.5e9
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth("fast")
    with pytest.raises(ValueError, match="positive"):
        parse_bandwidth("0GB/s")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("4.5h", 16200.0), ("30m", 1800.0), ("90s", 90.0), ("45", 45.0), ("1h30m", 5400.0), ("2d", 172800.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "h", "4.5 hours", "3x", "1h-2m"])
def test_parse_duration_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_young_known_values() -> None:
    # C = 0.15 s blocking, M = 4.5 h: sqrt(2 * 0.15 * 16200) = sqrt(4860)
    assert young_interval(0.15, 16200.0) == pytest.approx(69.713700, rel=1e-6)
    assert young_interval(60.0, 3600.0) == pytest.approx(math.sqrt(432000.0))


def test_daly_known_values() -> None:
    c, m = 60.0, 3600.0
    base = math.sqrt(2 * c * m)
    expected = base * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    assert daly_interval(c, m) == pytest.approx(expected)
    assert daly_interval(c, m) == pytest.approx(617.87565, rel=1e-6)  # 657.267 * 1.031355 - 60
    # Daly reduces to Young when C << M
    assert daly_interval(0.01, 1e6) == pytest.approx(young_interval(0.01, 1e6), rel=1e-3)
    # and is M itself when a save costs at least 2M
    assert daly_interval(100.0, 40.0) == 40.0


def test_intervals_reject_nonpositive() -> None:
    with pytest.raises(ValueError):
        young_interval(0.0, 100.0)
    with pytest.raises(ValueError):
        daly_interval(1.0, -5.0)


def test_lost_fraction_both_cases() -> None:
    tau, c, m, r = 600.0, 6.0, 36000.0, 120.0
    assert lost_fraction(tau, c, m, r, rework=True) == pytest.approx(c / tau + (tau / 2 + r) / m)
    assert lost_fraction(tau, c, m, r, rework=False) == pytest.approx(c / tau + r / m)


def test_young_interval_minimises_the_first_order_loss() -> None:
    c, m = 2.0, 7200.0
    tau = young_interval(c, m)
    best = lost_fraction(tau, c, m, rework=True)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert lost_fraction(tau * factor, c, m, rework=True) > best


def test_make_plan_unclamped() -> None:
    plan = make_plan(
        PlanInputs(state_bytes=1_500_000_000, write_bandwidth=2e9, mtbf_s=16200.0, blocking_s=0.15, step_time_s=0.5)
    )
    assert plan.flush_s == pytest.approx(0.75)
    assert plan.young_s == pytest.approx(math.sqrt(2 * 0.15 * 16200))
    assert plan.daly_s == pytest.approx(daly_interval(0.15, 16200.0))
    assert plan.interval_s == plan.daly_s and not plan.clamped
    assert plan.interval_steps == int(plan.interval_s // 0.5)
    assert plan.snapshot_s == pytest.approx(0.9)
    assert plan.margin_s == 5.0 and plan.snapshot_budget_s == 25.0 and plan.snapshot_fits
    assert plan.lost_hard_kill == pytest.approx(0.15 / plan.interval_s + plan.interval_s / 2 / 16200)
    assert plan.lost_with_snapshot == pytest.approx(0.15 / plan.interval_s)


def test_make_plan_clamps_to_flush_time_and_flags_a_snapshot_that_does_not_fit() -> None:
    # 840 GiB at 500 MB/s takes ~30 min to flush; Daly says ~8.5 min: clamp to the flush.
    plan = make_plan(
        PlanInputs(state_bytes=840 * 2**30, write_bandwidth=500e6, mtbf_s=1800.0, blocking_s=90.0, grace_s=120.0)
    )
    assert plan.daly_s < plan.flush_s
    assert plan.interval_s == pytest.approx(840 * 2**30 / 500e6) and plan.clamped
    assert plan.margin_s == pytest.approx(12.0)  # max(5 s, 10 % of the grace period), like the callback
    assert not plan.snapshot_fits
    assert plan.interval_steps is None


def test_grace_margin() -> None:
    assert grace_margin(30.0) == 5.0
    assert grace_margin(300.0) == 30.0


def test_make_plan_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="state size"):
        make_plan(PlanInputs(state_bytes=0, write_bandwidth=1e9, mtbf_s=10.0, blocking_s=1.0))
    with pytest.raises(ValueError, match="mtbf"):
        make_plan(PlanInputs(state_bytes=10, write_bandwidth=1e9, mtbf_s=0.0, blocking_s=1.0))


def test_plan_to_dict_is_json_ready() -> None:
    import json

    plan = make_plan(PlanInputs(state_bytes=10**9, write_bandwidth=1e9, mtbf_s=3600.0, blocking_s=0.1))
    body = json.loads(json.dumps(plan.to_dict()))
    assert body["inputs"]["state_bytes"] == 10**9
    assert body["interval_s"] == pytest.approx(plan.interval_s)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0s"), (0.0005, "500us"), (0.153, "153ms"), (2.5, "2.5s"), (42.0, "42.0s"), (5400.0, "1h 30m")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
