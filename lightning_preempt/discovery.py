"""Finding checkpoints: list, pick the newest valid one, and apply retention.

Only a committed checkpoint (one with a readable manifest) counts, for resume and for
retention alike: a partial directory can never push out the last good checkpoint.

Storage is shared (docs/security.md): retention deletes only directories named as this
package names them whose contents are all its own (:mod:`lightning_preempt.ownership`),
logs every deletion, never deletes the newest checkpoint that verifies, never counts a
corrupt one toward ``keep_last_n``, and leaves other runs' checkpoints alone.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any

from lightning_preempt.errors import CheckpointError, CorruptCheckpointError, UnsupportedFormatError
from lightning_preempt.manifest import MANIFEST_NAME, Manifest
from lightning_preempt.ownership import dir_step, is_our_dir_name, remove_if_ours
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

    A directory counts when it is named as this package names checkpoints
    (``step-NNNNNNNNNN``, committed or not) or holds a manifest of this package's format
    (e.g. ``ModelCheckpoint``'s ``epoch=0-step=100.ckpt/``). ``committed`` is true only
    when its manifest is present, parses, and names the step its directory name carries.
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
    ours = is_our_dir_name(name)
    match = _STEP_RE.search(name)
    name_step = dir_step(name) if ours else (int(match.group(1)) if match else None)
    if not store.exists(MANIFEST_NAME):
        if not ours or name_step is None:
            return None  # someone else's directory: not listed, never touched
        return CheckpointInfo(store.url, name, name_step, committed=False, problem="no manifest (partial save)")
    try:
        m = read_manifest(store)
        if name_step is not None and m.step != name_step:
            # Believing it would let one planted manifest outrank (and prune) real checkpoints.
            raise CorruptCheckpointError(
                f"the manifest says step {m.step} but the directory is named for step {name_step}",
                path=store.url,
                hint="The checkpoint was renamed, copied under another name or tampered with; it is not used.",
            )
    except CheckpointError as err:
        if not ours and _foreign_manifest(err):
            return None  # a manifest.json of some other tool
        return CheckpointInfo(
            store.url,
            name,
            name_step if name_step is not None else -1,
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


def _foreign_manifest(err: CheckpointError) -> bool:
    text = str(err)
    return text.startswith("manifest does not declare format") or text.startswith("manifest is not valid JSON")


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


def remove_checkpoint_dir(store: Store) -> None:
    """Delete a checkpoint: the manifest first, so a half-deleted one is never committed.

    Raises :class:`~lightning_preempt.errors.CheckpointExistsError` (nothing deleted)
    when the directory holds anything this package did not write.
    """
    remove_if_ours(store, why="removal requested")


# ---- which checkpoints are known to verify ------------------------------------------------
# A checkpoint this process committed (CRC32C computed from the bytes it wrote) or read in
# full and verified. Retention needs one verified checkpoint before it deletes anything;
# remembering them saves reading the newest checkpoint back after every save.
_VERIFIED: OrderedDict[tuple[str, bytes], None] = OrderedDict()
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_MAX = 256


def mark_verified(url: str, manifest: Manifest) -> None:
    """Record that the checkpoint at ``url`` with ``manifest`` is known to be intact."""
    with _VERIFIED_LOCK:
        _VERIFIED[(url.rstrip("/"), manifest.to_json())] = None
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)


def _is_verified(url: str, manifest: Manifest) -> bool:
    with _VERIFIED_LOCK:
        return (url.rstrip("/"), manifest.to_json()) in _VERIFIED


_WARNED_FOREIGN: set[str] = set()


def apply_retention(
    url: str,
    keep_last_n: int,
    storage_options: dict[str, Any] | None = None,
    *,
    protect: frozenset[str] = frozenset(),
    run_id: str | None = None,
) -> list[str]:
    """Keep the newest ``keep_last_n`` sound committed checkpoints; remove older ones and
    this package's corrupt checkpoints and uncommitted leftovers older than the newest
    checkpoint that verifies. Returns the removed URLs; every removal is logged at INFO.

    * Only directories named as this package names them and holding only its files are
      touched (:mod:`lightning_preempt.ownership`); anything else under ``url`` is left
      alone with one warning per process.
    * A checkpoint is *sound* when its files exist with their sizes; one that is not, or
      whose manifest is unreadable, never counts toward ``keep_last_n``.
    * The newest sound checkpoint is read in full for its CRC32C unless this process
      wrote or verified it; nothing is removed until one checkpoint verifies, and that one
      is kept.
    * ``run_id``: checkpoints whose manifest names another run are neither counted nor
      removed. ``protect`` names directories never to touch (a save still in flight).
    * A checkpoint written by a newer format version is never removed.
    """
    infos = list_checkpoints(url, storage_options)
    _warn_foreign(url, storage_options, infos)
    ours = [c for c in infos if is_our_dir_name(c.name) and not _other_run(c, run_id)]
    anchor: CheckpointInfo | None = None
    kept = 0
    doomed: list[tuple[CheckpointInfo, str]] = []
    for info in ours:
        if info.newer_format or info.name in protect:
            continue
        problem = None if info.committed else (info.problem or "not committed")
        if problem is None:
            problem = _soundness_problem(info, storage_options, need_crc=anchor is None)
        if problem is not None:
            # Corrupt or partial: never counted; removed only below the newest verified one.
            if anchor is not None:
                doomed.append((info, f"{problem}; older than the newest verified checkpoint"))
            continue
        if anchor is None:
            anchor = info  # the newest checkpoint that verifies: kept whatever keep_last_n says
        elif kept >= keep_last_n:
            doomed.append((info, f"retention keeps the newest {keep_last_n}"))
            continue
        kept += 1
    if anchor is None:
        if any(c.committed for c in ours):
            log.warning("lightning_preempt: retention in %s removed nothing: no checkpoint there verifies", url)
        return []
    removed = []
    for info, why in doomed:
        try:
            remove_if_ours(Store(info.path, storage_options), why=why)
        except CheckpointError as err:
            log.warning("lightning_preempt: retention left %s alone: %s", info.path, str(err).splitlines()[0])
            continue
        removed.append(info.path)
    return removed


def _other_run(info: CheckpointInfo, run_id: str | None) -> bool:
    other = info.manifest.run_id if info.manifest is not None else None
    return run_id is not None and other is not None and other != run_id


def _soundness_problem(info: CheckpointInfo, storage_options: dict[str, Any] | None, *, need_crc: bool) -> str | None:
    """Why a committed checkpoint cannot be counted (``None``: it can). ``need_crc``: it
    would become the newest verified one, so its CRC32C must be known to match."""
    store = Store(info.path, storage_options)
    assert info.manifest is not None
    try:
        if need_crc and not _is_verified(info.path, info.manifest):
            check_checkpoint(store, info.manifest, verify=True)
            mark_verified(info.path, info.manifest)
        else:
            check_checkpoint(store, info.manifest, verify="sizes")
    except (CheckpointError, OSError) as err:
        log.warning("lightning_preempt: retention does not count %s: %s", info.path, str(err).splitlines()[0])
        return str(err).splitlines()[0]
    return None


def _warn_foreign(url: str, storage_options: dict[str, Any] | None, infos: list[CheckpointInfo]) -> None:
    """One warning per process and root for what retention will never touch there."""
    if url in _WARNED_FOREIGN:
        return
    try:
        names = [n for n, _ in Store(url, storage_options).children()]
    except Exception:
        return
    foreign = sorted(n for n in names if not is_our_dir_name(n) and not n.startswith(".lp-"))
    if foreign:
        _WARNED_FOREIGN.add(url)
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        log.warning(
            "lightning_preempt: retention leaves alone what it did not create in %s: %s "
            "(only step-NNNNNNNNNN directories holding its own files are ever deleted)",
            url,
            shown,
        )
