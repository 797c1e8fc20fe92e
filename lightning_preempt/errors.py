"""Exceptions raised by lightning_preempt.

Every error derives from :class:`CheckpointError` (an ``Exception``, unlike DCP's
``CheckpointException``), names the path it is about, and ends with a ``HINT:`` that
says what to do next.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error this package raises about a checkpoint."""

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None) -> None:
        self.path = path
        self.hint = hint
        text = message if path is None or path in message else f"{message} (checkpoint: {path})"
        if hint:
            text = f"{text}\nHINT: {hint}"
        super().__init__(text)


class NotACheckpointError(CheckpointError):
    """The path holds no committed checkpoint of this package."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files do not match its manifest."""


class UnsupportedFormatError(CheckpointError):
    """A manifest written by a newer (or unknown) format version."""


class CheckpointWriteError(CheckpointError):
    """Writing or committing a checkpoint failed; nothing was committed."""


class CheckpointExistsError(CheckpointError):
    """A save targeted a path that already holds a committed checkpoint."""
