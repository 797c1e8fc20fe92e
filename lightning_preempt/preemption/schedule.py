"""When ranks agree on "preempt now?" (and "a time-based save is due?").

Policy over :class:`lightning_preempt.collective.groups.FlagAgreement`: ranks MAX-reduce
``[signalled, time_due, stop, proposed_k, tier0, signal steps, signal ms]`` (the last two:
how long ago this rank's signal came; the MAX is the first signal's) every ``k`` step boundaries, counted
alike on all ranks (a rank-local condition never decides who enters the collective).
``overlap`` launches the collective at a boundary and reads it at the *next* boundary,
whatever ``k`` is, so a flag raised between exchanges waits at most ``k + 1`` steps.
``k="auto"`` times the first steps and the exchanges, then proposes (in the same exchange)
the smallest ``k`` that keeps the agreement under :data:`COST_BUDGET` of a step, never wider
than a signal may wait (``interval_s``): every step wherever that is cheap enough
(docs/design.md, "Agreement cost and latency").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Literal

from lightning_preempt.collective.groups import FlagAgreement, ProcessGroup

CALIBRATION_STEPS = 20
MAX_K = 1000
#: The share of a step the agreement may cost in the quiet case (no signal) under ``"auto"``.
COST_BUDGET = 0.005
#: Calibration exchanges left out of the cost (the first collectives of a group set it up).
WARM_UP_EXCHANGES = 2


def auto_k(step_s: float, cost_s: float, interval_s: float, overlap: bool) -> int:
    """``"auto"``'s cadence: exchange every ``k`` steps, the smallest ``k`` whose cost per step
    (``cost_s / k``) is within :data:`COST_BUDGET` of ``step_s``, but never so wide that a
    signal waits longer than ``max(1 + overlap steps, interval_s)``: ``k + overlap`` steps."""
    step_s = max(step_s, 1e-6)
    by_cost = math.ceil(max(cost_s, 0.0) / (COST_BUDGET * step_s) * (1 - 1e-9))
    by_latency = int(interval_s / step_s * (1 + 1e-9)) - int(overlap)  # (0.3 / 0.05 is 5.999...)
    return max(1, min(MAX_K, by_cost, by_latency))


class AgreementSchedule:
    """Decides at which boundaries ranks agree, and agrees.

    Args:
        every_n_steps: exchange every N boundaries, or ``"auto"`` (:func:`auto_k`).
        interval_s: ``"auto"``: the longest a signal may wait for the ranks to act on it,
            beyond the ``1 + overlap`` steps an exchange every step takes.
        overlap: launch at one boundary, read at the next (hides the collective's latency).
        clock: what times an exchange's cost (tests give a fake one).
    """

    def __init__(
        self,
        every_n_steps: int | Literal["auto"],
        interval_s: float,
        overlap: bool,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if every_n_steps != "auto" and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(
                f"agree_every_n_steps must be a positive int or 'auto', got {every_n_steps!r}\n"
                "HINT: 'auto' agrees every step unless that costs over 0.5% of a step, and a "
                "signal waits at most 0.3 s (or 2 steps)."
            )
        self.auto = every_n_steps == "auto"
        self.k = 1 if self.auto else int(every_n_steps)
        self.interval_s = interval_s
        self.overlap = overlap
        self.clock = clock
        self._flags: FlagAgreement | None = None
        self._boundaries = 0
        self._times: list[float] = []
        self._costs: list[float] = []
        self._signal_boundary: int | None = None  # the first boundary this rank saw its signal at
        self._launched: tuple[int, float] = (0, 0.0)  # (boundary, now) of the exchange in flight
        #: From the first signal (on any rank) to the boundary where every rank learnt of it:
        #: steps (the agreed step minus the step before the signal came) and seconds; set when
        #: the first exchange read says "signalled", else ``None``.
        self.signal_steps: int | None = None
        self.signal_s: float | None = None
        #: The agreed tier-0 vote of the last boundary (MAX of the ranks' votes; 0 where no
        #: exchange was read: a boundary between exchanges, the first overlapped one). The
        #: vote's meaning is the memory tier's (engine/memory_tier.py ``MemoryTier.vote``).
        self.tier0 = 0

    def __getstate__(self) -> dict[str, object]:
        # a process group belongs to one fit; setup binds again (the clock may be a lambda)
        return {**self.__dict__, "_flags": None, "clock": None}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if self.clock is None:
            self.clock = time.perf_counter

    def bind(self, group: ProcessGroup | None) -> None:
        """Use ``group`` (a gloo group of its own; ``None`` without torch.distributed)."""
        self._flags = FlagAgreement(group, width=7)

    @property
    def bound(self) -> bool:
        return self._flags is not None

    @property
    def latency_steps(self) -> int:
        """The most steps a flag raised just after an exchange waits for every rank to act on it:
        ``k`` to the next exchange, and one more when that is read a boundary later."""
        overlapped = self.overlap and self._flags is not None and self._flags.active
        return self.k + int(overlapped)

    def at_boundary(
        self,
        now: float,
        signalled: bool,
        time_due: bool,
        stop: bool = False,
        tier0: int = 0,
        signal_age_s: float = 0.0,
    ) -> tuple[bool, bool, bool]:
        """At an optimizer-step boundary: ``(any rank signalled, any rank's save due, any
        rank must stop)``. ``stop`` (a failed save, a lost lease) travels in the same
        exchange as the signal flag; so does ``tier0`` (this rank's vote, see :attr:`tier0`),
        and ``signal_age_s``, how long ago this rank's signal came (see :attr:`signal_s`)."""
        flags = self._flags
        assert flags is not None, "bind() first"
        self._boundaries += 1
        self.tier0 = 0
        if signalled and self._signal_boundary is None:
            self._signal_boundary = self._boundaries  # seen here, between exchanges maybe
        proposal = self._calibrate(now)
        started = self.clock()
        agreed: list[int] | None = None
        overlapped = self.overlap and flags.active
        if overlapped and flags.pending:
            agreed = self._read(flags.flush(), now)  # launched at the previous boundary, on every rank
        if self._boundaries % self.k == 0:
            mine = [int(signalled), int(time_due), int(stop), proposal, tier0, *self._age(signalled, signal_age_s)]
            self._launched = (self._boundaries, now)
            if overlapped:
                flags.launch(mine)
            else:
                agreed = self._read(flags.exchange_now(mine), now)
        if self.auto and len(self._costs) < CALIBRATION_STEPS and flags.active:
            self._costs.append(self.clock() - started)
        if agreed is None:
            return False, False, False
        self.tier0 = agreed[4]
        return bool(agreed[0]), bool(agreed[1]), bool(agreed[2])

    def now(self, signalled: bool, stop: bool = False, signal_age_s: float = 0.0) -> tuple[bool, bool]:
        """Agree synchronously (validation, start-up): ``(any rank signalled, any must stop)``.
        A pending overlapped exchange is read here (its proposed ``k`` taken too)."""
        if self._flags is None:
            return signalled, stop
        age = self._age(signalled, signal_age_s)
        self._launched = (self._boundaries, 0.0)
        agreed = self._read(self._flags.exchange_now([int(signalled), 0, int(stop), 0, 0, *age]), None)
        return bool(agreed[0]), bool(agreed[2])

    def _age(self, signalled: bool, age_s: float) -> list[int]:
        """This rank's ``[steps, ms]`` since its signal came (``[0, 0]`` without one): the MAX
        over ranks is the first signal's."""
        if not signalled:
            return [0, 0]
        if self._signal_boundary is None:
            self._signal_boundary = self._boundaries + 1  # now(), after this step: 0 steps waited
        steps = self._boundaries - self._signal_boundary + 1  # it came during the step ending here
        return [steps, int(min(max(age_s, 0.0), 1e6) * 1000)]

    def _read(self, agreed: list[int], now: float | None) -> list[int]:
        """Take an exchange's result, read at this boundary (every rank alike): the proposed
        ``k``, and the first signal's age now (``now=None``: outside the steps, nothing added)."""
        if agreed[3]:
            self.k = agreed[3]  # read at the same boundary everywhere: every rank switches here
        if agreed[0] and self.signal_steps is None:  # the first agreement on it
            launched, then = self._launched  # the signal's age travelled as of the launch
            self.signal_steps = agreed[5] + self._boundaries - launched
            self.signal_s = agreed[6] / 1000 + (now - then if now is not None else 0.0)
        return agreed

    def flush(self) -> None:
        """Complete an overlapped exchange (every rank, before leaving the loop)."""
        if self._flags is not None:
            self._flags.flush()

    def _calibrate(self, now: float) -> int:
        """``"auto"``: this rank's proposed ``k`` at the last calibration boundary, else 0."""
        if not self.auto or self._flags is None or not self._flags.active or len(self._times) >= CALIBRATION_STEPS:
            return 0
        self._times.append(now)
        if len(self._times) < CALIBRATION_STEPS:
            return 0
        gaps = sorted(b - a for a, b in zip(self._times, self._times[1:], strict=False))
        # The mean, not the median: the budget is a share of every step, and an exchange's launch
        # has spikes on busy cores. The first two are the group's warm-up.
        costs = self._costs[WARM_UP_EXCHANGES:] or self._costs
        cost_s = sum(costs) / len(costs) if costs else 0.0
        return auto_k(gaps[len(gaps) // 2], cost_s, self.interval_s, self.overlap)
