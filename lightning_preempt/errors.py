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


class CheckpointNotFoundError(NotACheckpointError, FileNotFoundError):
    """Nothing at all exists at the path (also a :class:`FileNotFoundError`, as Lightning's
    own ``TorchCheckpointIO`` raises for a missing ``ckpt_path``)."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files do not match its manifest."""


class UnsupportedFormatError(CheckpointError):
    """A manifest written by a newer (or unknown) format version."""


class CheckpointWriteError(CheckpointError):
    """Writing or committing a checkpoint failed; nothing was committed."""


class CheckpointExistsError(CheckpointError):
    """A create-only commit found another writer's different manifest at the path (two
    writers raced for one path, or a drain found a different checkpoint at its target).
    Saving over a committed checkpoint is not an error: it is replaced (docs/dropin.md)."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint's pickled state needs a global outside the allow-list: loading it could
    run code from the storage. ``global_name`` names it (docs/security.md)."""

    def __init__(
        self, message: str, *, global_name: str | None = None, path: str | None = None, hint: str | None = None
    ) -> None:
        self.global_name = global_name
        super().__init__(message, path=path, hint=hint)


class ProgressWouldBeLostError(CheckpointError):
    """``dirpath`` shows an earlier run's progress (step directories, a ledger of committed
    saves), and none of it can be resumed: starting from step 0 would lose it silently."""


def earlier_save_failed(err: BaseException, what: str) -> CheckpointWriteError:
    """The error a later save (or wait) raises for ``what`` (an earlier save) that failed on the
    writer thread with ``err``: its first line, its path and its HINT when it had them."""
    return CheckpointWriteError(
        f"{what}: {str(err).splitlines()[0] if str(err) else repr(err)}",
        path=getattr(err, "path", None),
        hint=getattr(err, "hint", None) or "Check the storage; earlier committed checkpoints are intact.",
    )
