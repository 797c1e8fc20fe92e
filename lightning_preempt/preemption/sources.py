"""Preemption sources: anything that can announce "this node is being reclaimed".

Call order (the controller's): ``start()`` on the main thread, ``poll()`` at step
boundaries (cheap, never blocks), ``stop()`` at the end (idempotent).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol, runtime_checkable

# Real deadlines are 30 s to 15 min; a server's "year 9999" would overflow ``threading`` waits.
MAX_NOTICE_HORIZON_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Notice:
    """One announced reclaim; times are ``time.monotonic()``. ``deadline`` (when known) is
    clamped here to :data:`MAX_NOTICE_HORIZON_S` after ``received_at``, for every source."""

    source: str
    reason: str
    received_at: float
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.deadline is not None and not self.deadline <= self.received_at + MAX_NOTICE_HORIZON_S:
            # ``not <=`` also catches NaN.
            object.__setattr__(self, "deadline", self.received_at + MAX_NOTICE_HORIZON_S)

    @classmethod
    def now(cls, source: str, reason: str, *, within_s: float | None = None, deadline: float | None = None) -> Notice:
        """A notice received now; the node is gone ``within_s`` from now, or at ``deadline``."""
        now = time.monotonic()
        return cls(source, reason, now, now + within_s if within_s is not None else deadline)


@runtime_checkable
class PreemptionSource(Protocol):
    """The interface every source implements (see the module docstring for the call order)."""

    @property
    def name(self) -> str:
        """A short name for logs (``"signal"``, ``"aws"``…)."""

    def start(self) -> None:
        """Begin watching (install handlers, start a poller thread)."""

    def poll(self) -> Notice | None:
        """The first notice seen so far, or ``None``; cheap and non-blocking."""

    def stop(self) -> None:
        """Stop watching and release what :meth:`start` took; safe to call twice."""
