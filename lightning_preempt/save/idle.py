"""When a queued write starts: once the training thread waits (docs/design.md, "When the writer
starts").

The writer thread runs Python (planning, records, the commit) under the interpreter lock, and
torch releases that lock in every operator call and every tensor it frees: a training thread
that is still in Python when the write starts waits for the writer's Python at each of them
(4000 tensors, every step, 50 ms steps: 3.0-4.7 ms a step; docs/benchmarks.md, round 12). So a
periodic save's job first waits until the training thread stops using the CPU (its thread CPU
clock stands still: a sleep, a blocking wait, I/O), at most :data:`LIMIT_S` and a
:data:`INTERVAL_SHARE` of the time since the save before (the next save must not find this
one's write still running because it started late). Where the thread never stops (CPU-bound
training, a CUDA synchronisation that spins) the write starts at that limit, as before, later.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from lightning_preempt.save.history import SaveRecord

T = TypeVar("T")

_clock_gettime = time.clock_gettime  # (a module name a test replaces)

#: How long a write waits at most for the training thread to wait (seconds; 0: not at all).
LIMIT_S = 0.02
#: ... and at most this share of the time between the last two saves' starts.
INTERVAL_SHARE = 0.25
#: How often the training thread's CPU clock is read; it waits when it ran less than
#: :data:`IDLE_SHARE` of one such window.
WINDOW_S = 0.0005
IDLE_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class Gate:
    """A queued write's start (:meth:`after`): the training thread's CPU clock and the limit."""

    clock: int | None
    limit_s: float

    @staticmethod
    def here(history: Sequence[SaveRecord]) -> Gate:
        """The gate of a save made now on this (the training) thread; ``history`` ends with its
        record. The clock is taken on the thread itself, while it lives: on Linux it names the
        kernel's thread id, so reading it after the thread ended fails, never reads freed memory."""
        try:
            clock: int | None = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError, OverflowError):  # (not POSIX: no thread CPU clocks)
            clock = None
        limit = LIMIT_S
        if len(history) >= 2:
            limit = min(limit, INTERVAL_SHARE * max(0.0, history[-1].started - history[-2].started))
        return Gate(clock, limit)

    def after(self, job: Callable[[], T]) -> T:
        """``job()`` once :func:`wait_until_idle` returned (on the writer thread)."""
        wait_until_idle(self.clock, limit_s=self.limit_s)
        return job()


def wait_until_idle(clock: int | None, *, limit_s: float | None = None, window_s: float = WINDOW_S) -> bool:
    """Block until the thread whose CPU clock is ``clock`` used less than :data:`IDLE_SHARE`
    of a ``window_s``, or ``limit_s`` (default :data:`LIMIT_S`) passed. Returns whether it was
    seen waiting; ``False`` at once without a clock or once the thread has ended (a thread the
    OS kept off the CPU for a window counts as waiting too)."""
    limit = LIMIT_S if limit_s is None else limit_s
    if clock is None or limit <= 0:
        return False
    read = _clock_gettime
    deadline = time.monotonic() + limit
    try:
        used = read(clock)
        while time.monotonic() < deadline:
            time.sleep(window_s)  # (frees the interpreter lock: the training thread runs meanwhile)
            now = read(clock)
            if now - used < window_s * IDLE_SHARE:
                return True
            used = now
    except OSError:  # the thread ended
        return False
    return False
