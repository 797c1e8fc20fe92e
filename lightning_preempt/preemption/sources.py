"""Preemption sources: anything that can announce "this node is being reclaimed".

A source is polled from the training thread at step boundaries, so :meth:`poll` must be
cheap and never block (a source that talks to a server does so on its own thread and
only reads a field here). What one rank's source announces reaches every rank through the
controller's collective agreement, exactly like a signal.

Call order (the controller's): ``start()`` once training starts (main thread), ``poll()``
at boundaries, ``stop()`` when training ends, fails or is preempted (idempotent).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Notice:
    """One announced reclaim.

    Attributes:
        source: who announced it (``"SIGTERM"``, ``"aws"``, ``"gce"``…).
        reason: a short human-readable reason for the logs.
        received_at: ``time.monotonic()`` when this process learnt of it.
        deadline: ``time.monotonic()`` by which the node is gone, when the source knows it
            (a signal's deadline is ``received_at + grace_period_s``, set by the controller).
    """

    source: str
    reason: str
    received_at: float
    deadline: float | None = None


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
