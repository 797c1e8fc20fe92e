"""What one save measured (:class:`SaveRecord`) and how many of them a saver keeps."""

from __future__ import annotations

#: Save records kept in :attr:`Saver.history` (the newest ones).
HISTORY_KEPT = 64


class SaveRecord:
    """Timings of one save, filled in as it progresses (seconds, bytes)."""

    __slots__ = ("blocking_s", "bytes", "committed_s", "deferred_bytes", "error", "path", "started", "step", "waited_s")

    def __init__(self, path: str, step: int, started: float) -> None:
        self.path = path
        self.step = step
        self.started = started
        self.waited_s = 0.0
        self.blocking_s = 0.0
        self.committed_s: float | None = None
        self.bytes = 0
        self.deferred_bytes = 0  # copied after save() returned (overlapped staging)
        self.error: BaseException | None = None

    @property
    def throughput_bps(self) -> float | None:
        if not self.committed_s:
            return None
        return self.bytes / max(self.committed_s - self.blocking_s, 1e-9)
