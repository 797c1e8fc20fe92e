"""The newest committed checkpoint under a root that verifies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

from lightning_preempt.catalog.listing import CheckpointInfo, list_checkpoints
from lightning_preempt.catalog.verified import mark_verified
from lightning_preempt.errors import CheckpointError, UnsupportedFormatError
from lightning_preempt.read.verify import Verify, check_checkpoint
from lightning_preempt.storage.store import Store

log = logging.getLogger(__name__)


def newest_valid(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    verify: Verify = True,
    on_skip: Callable[[CheckpointInfo, str], None] | None = None,
    exclude: Collection[str] = (),
) -> CheckpointInfo | None:
    """The newest committed checkpoint under ``url`` whose files verify, or ``None``.

    ``verify``: ``True`` reads every file for its CRC32C; ``"sizes"`` only checks that
    every file exists with its size (one listing) and leaves the CRC32C to the load
    (:func:`~lightning_preempt.reader.load_full_checkpoint` raises
    :class:`CorruptCheckpointError`; call again with the failed path in ``exclude`` to
    fall back to the next one).

    Each skipped candidate (uncommitted, unreadable manifest, failed checksum) is reported
    to ``on_skip`` (default: a warning naming it and the reason). A checkpoint written by a
    newer format version is not skipped: :class:`UnsupportedFormatError` is raised.
    """
    report = on_skip or _warn_skip
    for info in list_checkpoints(url, storage_options):
        if info.newer_format:
            # Falling back would silently throw away the progress it holds.
            raise UnsupportedFormatError(
                f"the newest checkpoint {info.name} was written by a newer lightning_preempt ({info.problem})",
                path=info.path,
                hint="Upgrade lightning_preempt to resume from it, or pass an older ckpt_path explicitly.",
            )
        if info.path in exclude:
            report(info, "failed its check while loading")
            continue
        if not info.committed:
            report(info, info.problem or "not committed")
            continue
        if verify:
            try:
                check_checkpoint(Store(info.path, storage_options), info.manifest, verify=verify)
            except CheckpointError as err:
                report(info, str(err).splitlines()[0])
                continue
            if verify is True and info.manifest is not None:
                mark_verified(info.path, info.manifest)
        return info
    return None


def _warn_skip(info: CheckpointInfo, reason: str) -> None:
    log.warning("lightning_preempt: skipping checkpoint %s (step %d): %s", info.path, info.step, reason)

