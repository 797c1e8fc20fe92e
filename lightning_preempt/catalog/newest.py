"""The newest valid checkpoint, under one root or across a local and a remote tier: the one
place that picks. A candidate counts when committed, not in ``exclude``, and passing ``verify``:
``True`` every byte's CRC32C, ``"sizes"`` one listing (the load checks CRC32C), ``False``
the manifest only. A newer format version raises :class:`UnsupportedFormatError` rather
than falling back past the progress it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import Any

from lightning_preempt.catalog.listing import CheckpointInfo, complete_local_checkpoints, list_checkpoints
from lightning_preempt.catalog.verified import mark_verified
from lightning_preempt.errors import CheckpointError, UnsupportedFormatError
from lightning_preempt.read.verify import Fallback, Verify, check_checkpoint
from lightning_preempt.storage.store import Store

log = logging.getLogger(__name__)

#: ``on_skip(candidate, reason)``: told about every candidate passed over.
OnSkip = Callable[[CheckpointInfo, str], None]


def newest_valid(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    verify: Verify = True,
    on_skip: OnSkip | None = None,
    exclude: Collection[str] = (),
) -> CheckpointInfo | None:
    """The newest committed checkpoint under ``url`` that passes ``verify``, or ``None``; each
    one passed over goes to ``on_skip`` (default: a warning)."""
    return first_valid(list_checkpoints(url, storage_options), storage_options, verify=verify, on_skip=on_skip,
                       exclude=exclude)  # fmt: skip


def newest_in_tiers(
    local_root: str,
    remote_root: str | None,
    remote_options: dict[str, Any],
    *,
    local_usable: bool,
    verify: Verify,
    on_skip: OnSkip | None = None,
    exclude: Collection[str] = (),
) -> CheckpointInfo | None:
    """The newest valid checkpoint across a local and a remote tier (local wins a tie; remote
    looked at only when it may be newer). ``local_usable``: every rank runs on this host."""
    local = None
    if local_usable:
        complete = {c.name for c in complete_local_checkpoints(local_root)}

        def usable(info: CheckpointInfo) -> str | None:
            return None if info.name in complete else "files missing on this node's disk"

        local = first_valid(list_checkpoints(local_root, {}), {}, verify=verify, on_skip=on_skip, exclude=exclude,
                            usable=usable)  # fmt: skip
    if remote_root is None:
        return local
    floor = local.step if local is not None else -1
    remote_infos = list_checkpoints(remote_root, remote_options)
    if not any(c.committed and c.step > floor and c.path not in exclude for c in remote_infos):
        return local
    remote = first_valid(remote_infos, remote_options, verify=verify, on_skip=on_skip, exclude=exclude)
    if remote is None or (local is not None and local.step >= remote.step):
        return local
    return remote


def first_valid(
    candidates: Iterable[CheckpointInfo],
    storage_options: dict[str, Any] | None,
    *,
    verify: Verify,
    on_skip: OnSkip | None = None,
    exclude: Collection[str] = (),
    usable: Callable[[CheckpointInfo], str | None] | None = None,
) -> CheckpointInfo | None:
    """The first of ``candidates`` (newest first, as :func:`list_checkpoints` orders them)
    that counts (module docstring); ``usable(info)`` may pass one over with a reason."""
    report = on_skip or _warn_skip
    for info in candidates:
        if info.newer_format:
            raise UnsupportedFormatError(
                f"the newest checkpoint {info.name} was written by a newer lightning_preempt ({info.problem})",
                path=info.path,
                hint="Upgrade lightning_preempt to resume from it, or pass an older ckpt_path explicitly.",
            )
        reason = _why_not(info, storage_options, verify, exclude, usable)
        if reason is None:
            return info
        if reason:  # "" passes over silently: an uncommitted leftover of an unusable local tier
            report(info, reason)
    return None


def fallback(url: str, storage_options: dict[str, Any] | None, *, verify: Verify) -> Fallback:
    """For a load given a directory of checkpoints: the newest valid one after ``excluded``."""

    def next_one(excluded: list[str]) -> str | None:
        info = newest_valid(url, storage_options, verify=verify, exclude=excluded)
        return info.path if info is not None else None

    return next_one


def _why_not(
    info: CheckpointInfo,
    storage_options: dict[str, Any] | None,
    verify: Verify,
    exclude: Collection[str],
    usable: Callable[[CheckpointInfo], str | None] | None,
) -> str | None:
    """Why ``info`` does not count (``None``: it does)."""
    if info.path in exclude:
        return "failed its check while loading"
    if not info.committed:
        return "" if usable is not None else info.problem or "not committed"
    unusable = usable(info) if usable is not None else None
    if unusable is not None:
        return unusable
    if verify:
        try:
            check_checkpoint(Store(info.path, storage_options), info.manifest, verify=verify)
        except CheckpointError as err:
            return str(err).splitlines()[0]
        if verify is True and info.manifest is not None:
            mark_verified(info.path, info.manifest)
    return None


def _warn_skip(info: CheckpointInfo, reason: str) -> None:
    log.warning("lightning_preempt: skipping checkpoint %s (step %d): %s", info.path, info.step, reason)
