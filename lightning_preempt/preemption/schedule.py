"""When ranks agree on "preempt now?" (and "a time-based save is due?").

Policy over :class:`lightning_preempt.collective.groups.FlagAgreement`: ranks MAX-reduce
``[signalled, time_due, stop, proposed_k, tier0]`` every ``k`` step boundaries, counted
alike on all ranks (a rank-local condition never decides who enters the collective).
``k="auto"`` proposes ``k ~ interval_s / step time`` in the same exchange (one costs ~1 ms
on gloo); ``overlap`` reads the collective one boundary later.
"""

from __future__ import annotations

from typing import Literal

from lightning_preempt.collective.groups import FlagAgreement, ProcessGroup

CALIBRATION_STEPS = 20
MAX_K = 1000


class AgreementSchedule:
    """Decides at which boundaries ranks agree, and agrees."""

    def __init__(self, every_n_steps: int | Literal["auto"], interval_s: float, overlap: bool) -> None:
        if every_n_steps != "auto" and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(
                f"agree_every_n_steps must be a positive int or 'auto', got {every_n_steps!r}\n"
                "HINT: 'auto' keeps the agreement cost near 1% of a step with bounded latency."
            )
        self.auto = every_n_steps == "auto"
        self.k = 1 if self.auto else int(every_n_steps)
        self.interval_s = interval_s
        self.overlap = overlap
        self._flags: FlagAgreement | None = None
        self._boundaries = 0
        self._times: list[float] = []
        #: The agreed tier-0 vote of the last boundary (MAX of the ranks' votes; 0 where no
        #: exchange happened: a boundary between exchanges, the first overlapped one). The
        #: vote's meaning is the memory tier's (engine/memory_tier.py ``MemoryTier.vote``).
        self.tier0 = 0

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_flags": None}  # a process group belongs to one fit; setup binds again

    def bind(self, group: ProcessGroup | None) -> None:
        """Use ``group`` (a gloo group of its own; ``None`` without torch.distributed)."""
        self._flags = FlagAgreement(group, width=5)

    @property
    def bound(self) -> bool:
        return self._flags is not None

    def at_boundary(
        self, now: float, signalled: bool, time_due: bool, stop: bool = False, tier0: int = 0
    ) -> tuple[bool, bool, bool]:
        """At an optimizer-step boundary: ``(any rank signalled, any rank's save due, any
        rank must stop)``. ``stop`` (a failed save, a lost lease) travels in the same
        exchange as the signal flag; so does ``tier0`` (this rank's vote, see :attr:`tier0`)."""
        assert self._flags is not None, "bind() first"
        self._boundaries += 1
        self.tier0 = 0
        proposal = self._calibrate(now)
        if self._boundaries % self.k != 0:
            return False, False, False
        any_signal, any_due, any_stop, new_k, self.tier0 = self._flags.exchange(
            [int(signalled), int(time_due), int(stop), proposal, tier0], overlap=self.overlap
        )
        if new_k:
            self.k = new_k
        return bool(any_signal), bool(any_due), bool(any_stop)

    def now(self, signalled: bool, stop: bool = False) -> tuple[bool, bool]:
        """Agree synchronously (validation, start-up): ``(any rank signalled, any must stop)``."""
        if self._flags is None:
            return signalled, stop
        agreed = self._flags.exchange_now([int(signalled), 0, int(stop), 0, 0])
        return bool(agreed[0]), bool(agreed[2])

    def flush(self) -> None:
        """Complete an overlapped exchange (every rank, before leaving the loop)."""
        if self._flags is not None:
            self._flags.flush()

    def _calibrate(self, now: float) -> int:
        if not self.auto or self._flags is None or not self._flags.active or len(self._times) >= CALIBRATION_STEPS:
            return 0
        self._times.append(now)
        if len(self._times) < CALIBRATION_STEPS:
            return 0
        gaps = sorted(b - a for a, b in zip(self._times, self._times[1:], strict=False))
        step_s = max(gaps[len(gaps) // 2], 1e-6)
        return max(1, min(MAX_K, int(self.interval_s / step_s)))
