"""Tier 0's loss bound: at most ``bound`` steps lost to a node that dies without a signal
(docs/tier0.md "The loss bound").

A copy started at step ``s`` holds ``s`` only once it committed (and, on several nodes, its
peer copy finished); until then a node loss resumes from the copy before it (the *anchor*). So
at the boundary where ``step - anchor`` reaches ``bound`` training waits for the copy in flight
(or, none being newer than the anchor, makes one and waits) before the next step runs. A fixed
``tier0_every_n_steps=K`` promises ``2 K``; ``"auto"`` promises ``K + C + A`` (the interval, the
copy's measured duration and the agreement's latency, in steps), the largest of the ranks'
estimates, agreed at every copy start (engine/memory_tier.py ``MemoryTier.path``).

This module is the bookkeeping and needs no process group: which copies are in flight,
what each rank reports of them, the anchor. The engine does the collectives
(engine/memory_tier.py) and the waiting (engine/engine.py ``Engine.step_end``).
"""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import Future
from dataclasses import dataclass, field

from lightning_preempt.save.history import SaveRecord
from lightning_preempt.storage.private import read_private, write_private

#: What a rank reports of a copy in flight (:meth:`Copy.status`).
RUNNING, HELD, FAILED = 0, 1, 2
#: The carried schedule's file in the node's tier-0 directory (one per node).
SCHEDULE_FILE = ".lp-tier0-schedule.json"


@dataclass
class Copy:
    """One tier-0 copy as this rank sees it: its saver record (``None``: this rank wrote
    nothing) and what follows it on the job thread (seal, retention, the peer copy), whose
    result is ``False`` when the peer copy failed."""

    step: int
    record: SaveRecord | None
    follow: list[Future[bool | None]] = field(default_factory=list)

    def status(self) -> int:
        """RUNNING, HELD (committed, and whatever follows it succeeded) or FAILED."""
        rec = self.record
        if rec is not None and rec.error is not None:
            return FAILED
        if rec is not None and rec.committed_s is None:
            return RUNNING
        for job in self.follow:
            if not job.done():
                return RUNNING
            if job.exception() is not None or job.result() is False:
                return FAILED
        return HELD


def fixed_bound(every: int) -> int:
    """The bound a fixed K promises: a copy every K steps, each waited for after K more."""
    return 2 * every


def auto_bound(every: int, copy_steps: int, agree_steps: int) -> int:
    """The bound auto promises: its interval, the copy's duration and the agreement's
    latency, in steps (each at least 1)."""
    return max(1, every) + max(1, copy_steps) + max(0, agree_steps)


class LossBound:
    """The anchor (the newest step a node loss surely resumes from), the copies in flight
    after it, and the bound in force (``None``: not known yet, nothing is waited for)."""

    def __init__(self) -> None:
        self.anchor: int | None = None
        self.bound: int | None = None
        self.pending: list[Copy] = []

    def resumed(self, step: int) -> None:
        """Training (re)starts at ``step``: it is held (the checkpoint just loaded)."""
        self.anchor, self.pending = step, []

    def started(self, copy: Copy) -> None:
        self.pending.append(copy)

    def statuses(self) -> list[int]:
        """This rank's report on each copy in flight (oldest first)."""
        return [c.status() for c in self.pending]

    def confirm(self, reports: list[list[int]]) -> list[int]:
        """Every rank's :meth:`statuses` (gathered; alike on every rank, so the same answer
        everywhere): the oldest copies every rank holds move the anchor, those a rank failed
        are dropped. Stops at the first one some rank still runs. Returns the failed steps."""
        failed: list[int] = []
        while self.pending and all(len(r) == len(self.pending) for r in reports):
            column = [r[0] for r in reports]
            if RUNNING in column:
                break
            copy = self.pending.pop(0)
            reports = [r[1:] for r in reports]
            if FAILED in column:
                failed.append(copy.step)
            else:
                self.anchor = copy.step if self.anchor is None else max(self.anchor, copy.step)
        return failed

    def over(self, step: int) -> bool:
        """Whether training must not go past ``step`` before a newer copy holds."""
        return self.bound is not None and self.anchor is not None and step - self.anchor >= self.bound

    def waiting_for(self, step: int) -> list[Copy]:
        """The copies to wait for at ``step`` (in order): up to the oldest one newer than the
        bound's window, or all of them when none is (then a new copy is needed as well)."""
        assert self.bound is not None
        for i, copy in enumerate(self.pending):
            if step - copy.step < self.bound:
                return self.pending[: i + 1]
        return list(self.pending)


def read_schedule(root: str) -> dict[str, int] | None:
    """The schedule a previous launch on this node left (``{"every", "copy_steps"}``), if
    any: a restarted launch keeps its bound from its first step instead of measuring anew.
    Only a regular file of this uid counts (storage/private.py): a FIFO there cannot hang
    the set-up, another user's file is not taken."""
    try:
        data = json.loads(read_private(os.path.join(root, SCHEDULE_FILE), max_bytes=4096))
        every, copy_steps = int(data["every"]), int(data["copy_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"every": every, "copy_steps": copy_steps} if every >= 1 and copy_steps >= 1 else None


def write_schedule(root: str, every: int, copy_steps: int) -> None:
    """Leave the schedule for the next launch on this node (replaced whole, never torn; 0600,
    never written through a planted symlink: storage/private.py)."""
    with contextlib.suppress(OSError):  # best effort: the next launch measures again
        write_private(os.path.join(root, SCHEDULE_FILE), json.dumps({"every": every, "copy_steps": copy_steps}).encode())
