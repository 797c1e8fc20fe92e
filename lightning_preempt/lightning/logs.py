"""What Lightning logs about our checkpoints: its messages that our auto-resume route makes
untrue are filtered, and its "Restoring states from …" lines name the real checkpoint
instead of the resume pointer (docs/design.md, "Auto-resume")."""

from __future__ import annotations

import logging
import warnings


def quiet_auto_resume_warnings() -> None:
    """Lightning warns about "last" checkpoints whenever an ``OnExceptionCheckpoint`` is
    present and ``fit()`` gets no ``ckpt_path``: that is exactly our auto-resume route, so the
    text misleads. The warnings are raised inside ``fit`` before any hook of ours runs, so no
    ``catch_warnings`` block can scope them; the filters match those two messages only and
    are added when a callback is constructed (never at import; re-adding replaces them)."""
    warnings.filterwarnings("ignore", message=r".*ckpt_path=None\)` was called without a model.*")
    warnings.filterwarnings("ignore", message=r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint.*")


class PointerNames(logging.Filter):
    """While installed, Lightning's rank-zero log lines that name the resume pointer name the
    checkpoint it stands for ("Restoring states from the checkpoint path at …", "Restored all
    states from the checkpoint at …"). Lightning formats those lines itself (f-strings), so
    the pointer's path is replaced in the record's message."""

    def __init__(self) -> None:
        super().__init__()
        self._names: tuple[str, str] | None = None
        self._logger: logging.Logger | None = None

    def install(self, pointer: str, checkpoint: str) -> None:
        """From now on ``pointer`` reads ``checkpoint`` in Lightning's rank-zero log."""
        from lightning_utilities.core import rank_zero  # the logger rank_zero_info writes to

        self.remove()
        self._names = (pointer, checkpoint)
        self._logger = rank_zero.log
        self._logger.addFilter(self)

    def remove(self) -> None:
        if self._logger is not None:
            self._logger.removeFilter(self)
        self._logger = None
        self._names = None

    def filter(self, record: logging.LogRecord) -> bool:
        names = self._names
        if names is not None and isinstance(record.msg, str) and names[0] in record.msg:
            record.msg = record.msg.replace(*names)
        return True

    def __getstate__(self) -> dict[str, object]:
        return {}  # belongs to one fit (the logger holds it while installed)

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]
