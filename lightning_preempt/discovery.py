"""Finding checkpoints: list, pick the newest valid one, and apply retention.

Only a committed checkpoint (one with a readable manifest) counts, for resume and for
retention alike: a partial directory can never push out the last good checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Collection
from typing import Any

from lightning_preempt.errors import CheckpointError, UnsupportedFormatError
from lightning_preempt.manifest import MANIFEST_NAME, Manifest
from lightning_preempt.reader import Verify, check_checkpoint, read_manifest
from lightning_preempt.storage import Store

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"(?:^|[-_=])step[=_-]?(\d+)")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory under a root URL."""

    path: str
    name: str
    step: int
    committed: bool
    epoch: int | None = None
    created_unix: float | None = None
    size_bytes: int | None = None
    world_size: int | None = None
    manifest: Manifest | None = dataclasses.field(default=None, repr=False, compare=False)
    problem: str | None = None
    newer_format: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("manifest")
        return d


def checkpoint_name(step: int) -> str:
    """The directory name the callback uses for the checkpoint of ``step``."""
    return f"step-{step:010d}"


def list_checkpoints(url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Every checkpoint directory directly under ``url``, newest first.

    A directory counts when it has a manifest or its name carries a step (``step-…``,
    ``…-step=N…``). ``committed`` is true only when its manifest is present and parses.
    """
    root = Store(url, storage_options)
    found: list[CheckpointInfo] = []
    for name in root.list_dirs():
        found_info = _describe(root, name)
        if found_info is not None:
            found.append(found_info)
    found.sort(key=lambda c: (c.step, c.committed, c.created_unix or 0.0, c.name), reverse=True)
    return found


def _describe(root: Store, name: str) -> CheckpointInfo | None:
    store = root.child(name)
    match = _STEP_RE.search(name)
    name_step = int(match.group(1)) if match else None
    if not store.exists(MANIFEST_NAME):
        if name_step is None:
            return None
        return CheckpointInfo(store.url, name, name_step, committed=False, problem="no manifest (partial save)")
    try:
        m = read_manifest(store)
    except CheckpointError as err:
        return CheckpointInfo(
            store.url,
            name,
            name_step or -1,
            committed=False,
            problem=str(err).splitlines()[0],
            newer_format=isinstance(err, UnsupportedFormatError),
        )
    return CheckpointInfo(
        path=store.url,
        name=name,
        step=m.step,
        committed=True,
        epoch=m.epoch,
        created_unix=m.created_unix,
        size_bytes=m.total_bytes,
        world_size=m.world_size,
        manifest=m,
    )


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
        return info
    return None


def _warn_skip(info: CheckpointInfo, reason: str) -> None:
    log.warning("lightning_preempt: skipping checkpoint %s (step %d): %s", info.path, info.step, reason)


def remove_checkpoint_dir(store: Store) -> None:
    """Delete a checkpoint: the manifest first, so a half-deleted one is never committed."""
    store.rm_file(MANIFEST_NAME)
    store.rm_tree()


def apply_retention(
    url: str,
    keep_last_n: int,
    storage_options: dict[str, Any] | None = None,
    *,
    protect: frozenset[str] = frozenset(),
) -> list[str]:
    """Keep the newest ``keep_last_n`` committed checkpoints; remove older ones and the
    uncommitted leftovers older than the newest committed one. Returns removed URLs.

    ``protect`` names directories never to touch (a save still in flight).
    """
    infos = list_checkpoints(url, storage_options)
    committed = [c for c in infos if c.committed]
    if not committed:
        return []
    newest_step = committed[0].step
    doomed = committed[keep_last_n:]
    # Never delete what a newer version wrote: we cannot tell whether it is complete.
    doomed += [c for c in infos if not c.committed and not c.newer_format and c.step < newest_step]
    removed = []
    for info in doomed:
        if info.name in protect:
            continue
        remove_checkpoint_dir(Store(info.path, storage_options))
        removed.append(info.path)
    return removed
