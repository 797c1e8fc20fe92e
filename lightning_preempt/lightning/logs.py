"""What Lightning logs about our checkpoints: its messages that our auto-resume route and
exact resume make untrue are filtered, and its "Restoring states from …" lines name the real
checkpoint instead of the resume pointer (docs/design.md, "Auto-resume")."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import cast

NOT_RESUMABLE_LOADER = r"You're resuming from a checkpoint that ended before the epoch ended"
"""Lightning's warning on a mid-epoch restart that a loader is not resumable: untrue once exact
resume put every loader back (:attr:`ExactResume.positions_restored`). Matched by its start."""


class QuietWarning:
    """One of Lightning's warnings, not shown while installed: our own ``"ignore"`` entry at the
    front of ``warnings.filters``, removed by identity (no ``catch_warnings`` block spans two
    hooks, and exiting one would undo filters others added meanwhile)."""

    def __init__(self, message: str, category: type[Warning] = Warning) -> None:
        self.message = message
        self.category = category
        self._entry: object | None = None

    def install(self) -> None:
        """From now on until :meth:`remove`, the warning is not shown (in this process)."""
        self.remove()
        warnings.filterwarnings("ignore", message=self.message, category=self.category)
        self._entry = warnings.filters[0]  # filterwarnings inserts at the front

    def remove(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            return
        # `warnings.filters` is looked up now: catch_warnings (pytest's too) swaps the list.
        filters = cast(list[object], warnings.filters)  # typeshed says Sequence; it is the list
        for i, item in enumerate(filters):
            if item is entry:
                # No cache to reset: an "ignore" leaves no entry in the warning registries.
                del filters[i]
                return


AUTO_RESUME_WARNINGS = (
    r".*ckpt_path=None\)` was called without a model",
    r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint",
)
"""Lightning's warnings about "last" checkpoints when ``fit()`` gets no ``ckpt_path`` and an
``OnExceptionCheckpoint`` is present: exactly our auto-resume route, so the text misleads."""


@contextlib.contextmanager
def quiet_auto_resume_warnings() -> Iterator[None]:
    """:data:`AUTO_RESUME_WARNINGS` not shown inside the block (``_compat.quiet_ckpt_path_choice``)."""
    quiet = [QuietWarning(message) for message in AUTO_RESUME_WARNINGS]
    for q in quiet:
        q.install()
    try:
        yield
    finally:
        for q in quiet:
            q.remove()


class PointerNames(logging.Filter):
    """While installed, Lightning's rank-zero log lines ("Restoring states from …") name the
    checkpoint the resume pointer stands for (the path is replaced in the record's message)."""

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
