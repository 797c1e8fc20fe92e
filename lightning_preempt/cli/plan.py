"""How often to checkpoint: Young/Daly intervals and expected time lost. Pure math, no I/O;
symbols and formulas: docs/cli.md ("plan").
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from lightning_preempt.preemption.deadline import grace_margin

DEFAULT_COPY_BANDWIDTH = 10e9  # bytes/s, device or host memory -> host staging buffer
DEFAULT_GRACE_S = 30.0

_SIZE_UNITS = (
    {"": 1, "b": 1}
    | {f"{p}{unit}": 1000 ** (i + 1) for i, p in enumerate("kmgtp") for unit in ("", "b")}
    | {f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgtp")}
)
_TIME_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``1.5GB`` (powers of 1000), ``840GiB`` (powers of 1024), ``123``."""
    match = re.fullmatch(rf"\s*({_NUMBER})\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(3).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot read a size from {text!r} (examples: 1.5GB, 840GiB, 2e9)")
    return round(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_bandwidth(text: str) -> float:
    """Bytes per second in ``text``: ``2GB/s``, ``800MiB/s``, ``2GB`` (per second implied)."""
    body = re.sub(r"(/s|ps|/sec)$", "", str(text).strip(), flags=re.IGNORECASE)
    try:
        value = float(parse_size(body))
    except ValueError:
        raise ValueError(f"cannot read a bandwidth from {text!r} (examples: 2GB/s, 800MiB/s)") from None
    if value <= 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    return value


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``4.5h``, ``30m``, ``90s``, ``1h30m``, ``2d``, ``45`` (seconds)."""
    body = str(text).strip().lower().replace(" ", "")
    parts = re.findall(rf"({_NUMBER})([a-z]*)", body)
    if not body or "".join(p[0] + p[2] for p in parts) != body or any(p[2] not in _TIME_UNITS for p in parts):
        raise ValueError(f"cannot read a duration from {text!r} (examples: 4.5h, 30m, 90s, 1h30m)")
    return sum(float(number) * _TIME_UNITS[unit] for number, _, unit in parts)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal interval ``sqrt(2 C M)``."""
    _positive(cost_s=cost_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order interval; ``M`` itself when ``C >= 2M``."""
    _positive(cost_s=cost_s, mtbf_s=mtbf_s)
    c, m = cost_s, mtbf_s
    if c >= 2.0 * m:
        return m
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(c / (2.0 * m)) / 3.0 + c / (18.0 * m)) - c


def lost_fraction(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0, *, rework: bool) -> float:
    """Expected fraction of wall time lost: ``C/tau + (tau/2 + R)/M``, or ``C/tau + R/M``
    without rework (a SIGTERM snapshot that fits the grace period)."""
    _positive(interval_s=interval_s, mtbf_s=mtbf_s)
    per_failure = (interval_s / 2.0 if rework else 0.0) + restart_s
    return cost_s / interval_s + per_failure / mtbf_s


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """Everything the plan is computed from (bytes, bytes/s, seconds)."""

    state_bytes: int
    write_bandwidth: float
    mtbf_s: float
    blocking_s: float
    grace_s: float = DEFAULT_GRACE_S
    restart_s: float = 0.0
    step_time_s: float | None = None
    margin_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """The result of :func:`make_plan` (seconds unless named otherwise)."""

    inputs: PlanInputs
    flush_s: float
    young_s: float
    daly_s: float
    interval_s: float
    clamped: bool
    interval_steps: int | None
    snapshot_s: float
    margin_s: float
    snapshot_budget_s: float
    snapshot_fits: bool
    lost_hard_kill: float
    lost_with_snapshot: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (inputs nested under ``inputs``)."""
        return dataclasses.asdict(self)


def make_plan(inputs: PlanInputs) -> Plan:
    """Young/Daly interval, clamped to the flush time, and the expected time lost."""
    if inputs.state_bytes <= 0:
        raise ValueError(f"state size must be positive, got {inputs.state_bytes}")
    if inputs.write_bandwidth <= 0:
        raise ValueError(f"write bandwidth must be positive, got {inputs.write_bandwidth}")
    if inputs.blocking_s < 0:
        raise ValueError(f"blocking time cannot be negative, got {inputs.blocking_s}")
    if inputs.step_time_s is not None and inputs.step_time_s <= 0:
        raise ValueError(f"step time must be positive, got {inputs.step_time_s}")
    cost = max(inputs.blocking_s, 1e-9)  # a free save would make every interval "optimal"
    flush = inputs.state_bytes / inputs.write_bandwidth
    young = young_interval(cost, inputs.mtbf_s)
    daly = daly_interval(cost, inputs.mtbf_s)
    interval = max(daly, flush)
    steps = None if inputs.step_time_s is None else max(1, int(interval // inputs.step_time_s))
    margin = inputs.margin_s if inputs.margin_s is not None else grace_margin(inputs.grace_s)
    snapshot = inputs.blocking_s + flush
    budget = inputs.grace_s - margin
    return Plan(
        inputs=inputs,
        flush_s=flush,
        young_s=young,
        daly_s=daly,
        interval_s=interval,
        clamped=interval > daly,
        interval_steps=steps,
        snapshot_s=snapshot,
        margin_s=margin,
        snapshot_budget_s=budget,
        snapshot_fits=snapshot <= budget,
        lost_hard_kill=lost_fraction(interval, cost, inputs.mtbf_s, inputs.restart_s, rework=True),
        lost_with_snapshot=lost_fraction(interval, cost, inputs.mtbf_s, inputs.restart_s, rework=False),
    )


def format_duration(seconds: float) -> str:
    """``93784.0`` -> ``1d 2h 3m 4s``; short durations keep decimals (``0.153s``)."""
    if seconds == 0:
        return "0s"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g}us"
    if seconds < 1:
        return f"{seconds * 1e3:.3g}ms"
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{seconds:.1f}s"
    whole = round(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size or (unit == "s" and not parts):
            parts.append(f"{whole // size}{unit}")
            whole %= size
    return " ".join(parts)


def format_bytes(n: float) -> str:
    """Decimal units, as storage vendors quote them: ``1.50 GB``."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")

