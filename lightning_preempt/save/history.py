"""What one save measured (:class:`SaveRecord`), how many of them a saver keeps, and the step a
checkpoint records."""

from __future__ import annotations

import dataclasses
from typing import Any

#: Save records kept in :attr:`Saver.history` (the newest ones).
HISTORY_KEPT = 64


@dataclasses.dataclass(eq=False, slots=True)
class SaveRecord:
    """Timings of one save, filled in as it progresses (seconds, bytes)."""

    path: str
    step: int
    started: float
    waited_s: float = 0.0
    blocking_s: float = 0.0
    committed_s: float | None = None
    bytes: int = 0
    deferred_bytes: int = 0  # copied after save() returned (overlapped staging)
    #: writes in a row, this one's included, that did not find the training thread waiting
    #: (save/idle.py; 0: this one did, skipped looks count as not); None: started at once
    idle_misses: int | None = None
    error: BaseException | None = None

    @property
    def throughput_bps(self) -> float | None:
        if not self.committed_s:
            return None
        return self.bytes / max(self.committed_s - self.blocking_s, 1e-9)


def checkpoint_step(checkpoint: dict[str, Any]) -> int:
    """The training step a checkpoint records: Lightning's ``global_step``, else a plain
    ``step`` (a hand-written loop's ``fabric.save(path, {"step": ...})``); -1 when neither."""
    for key in ("global_step", "step"):
        value = checkpoint.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return -1
