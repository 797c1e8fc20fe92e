"""When a queued write starts: once the training thread waits (the why and the figures:
docs/design.md, "When the writer starts").

The writer's Python holds the interpreter lock, which a training thread still in Python waits
for at every torch call; so a periodic save's job first waits until the training thread's CPU
clock stands still (a sleep, a blocking wait, I/O), at most :data:`LIMIT_S` and half the slack
the save before left (no wait when the writer is behind); where training never stops, writes
start at once after two misses, one save in :data:`PROBE_EVERY` looking again.
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
#: ... and at most this share of the slack the save before left: the time between the last two
#: saves' starts less that save's write (so a write that starts late still ends before the next
#: save; none when the writer has no slack).
SLACK_SHARE = 0.5
#: How often the training thread's CPU clock is read; it waits when it ran less than
#: :data:`IDLE_SHARE` of one such window.
WINDOW_S = 0.0005
IDLE_SHARE = 0.1
#: After this many writes in a row that did not find training waiting, writes start at once,
#: but for one save in :data:`PROBE_EVERY`, which looks again.
MISSES_OFF = 2
PROBE_EVERY = 16


@dataclasses.dataclass(frozen=True)
class Gate:
    """A queued write's start (:meth:`after`): the training thread's CPU clock, the limit, and
    the save's record, which keeps what the gate found (:attr:`SaveRecord.idle_misses`)."""

    clock: int | None
    limit_s: float
    record: SaveRecord | None = None
    misses_before: int = 0

    @staticmethod
    def here(history: Sequence[SaveRecord]) -> Gate:
        """The gate of a save made now on this (the training) thread; ``history`` ends with its
        record. The clock is taken on the thread itself, while it lives: on Linux it names the
        kernel's thread id, so reading it after the thread ended fails, never reads freed memory.
        After :data:`MISSES_OFF` writes in a row that did not find training waiting (CPU-bound
        training, a spinning synchronisation) it does not look, but once in :data:`PROBE_EVERY`
        saves: the polling would cost training and find nothing."""
        record = history[-1] if history else None
        before = history[-2].idle_misses if len(history) >= 2 else None
        misses = before or 0
        if misses >= MISSES_OFF and misses % PROBE_EVERY:
            if record is not None:
                record.idle_misses = misses + 1
            return Gate(None, 0.0)
        try:
            clock: int | None = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError, OverflowError):  # (not POSIX: no thread CPU clocks)
            clock = None
        return Gate(clock, _limit(history), record, misses)

    def after(self, job: Callable[[], T]) -> T:
        """``job()`` once :func:`wait_until_idle` returned (on the writer thread)."""
        found = wait_until_idle(self.clock, limit_s=self.limit_s)
        if self.record is not None and self.clock is not None and self.limit_s > 0:
            self.record.idle_misses = 0 if found else self.misses_before + 1
        return job()


def wait_until_idle(clock: int | None, *, limit_s: float | None = None) -> bool:
    """Block until the thread whose CPU clock is ``clock`` used less than :data:`IDLE_SHARE`
    of a :data:`WINDOW_S`, or ``limit_s`` (default :data:`LIMIT_S`) passed. Returns whether it was
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
            time.sleep(WINDOW_S)  # (frees the interpreter lock: the training thread runs meanwhile)
            now = read(clock)
            if now - used < WINDOW_S * IDLE_SHARE:
                return True
            used = now
    except OSError:  # the thread ended
        return False
    return False


def _limit(history: Sequence[SaveRecord]) -> float:
    """:data:`LIMIT_S`, within :data:`SLACK_SHARE` of the slack the previous save's write left
    before this save (``history[-1]``); 0 when the writer is behind: that write still runs, or
    this save waited for it."""
    if len(history) < 2:
        return LIMIT_S
    previous, this = history[-2], history[-1]
    if previous.committed_s is None or this.waited_s > WINDOW_S:  # still writing, or this save
        return 0.0  # waited for its buffers: the writer is behind (or the save failed)
    write_s = previous.committed_s - previous.blocking_s
    slack = (this.started - previous.started) - write_s
    return max(0.0, min(LIMIT_S, SLACK_SHARE * slack))
