"""Retention, the one rule for every tier: keep the newest ``keep_last_n`` sound checkpoints
and delete older ones, only ever what this package wrote (catalog/ownership.py). Old runs'
ledgers follow: once none of a run's checkpoints is left, its ledger goes too. Tier 0 over
several nodes counts its copies without checking their files (``check_files=False``: each
node's copy holds only some shares).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from typing import Any

from lightning_preempt.catalog.ledger_reader import ledger_store, run_ids
from lightning_preempt.catalog.listing import CheckpointInfo, list_checkpoints
from lightning_preempt.catalog.ownership import remove_if_ours
from lightning_preempt.catalog.verified import is_verified, mark_verified
from lightning_preempt.errors import CheckpointError
from lightning_preempt.format.names import HIDDEN_PREFIX, LEDGER_COMPACT_RE, LEDGER_RECORD_RE, dir_step
from lightning_preempt.read.verify import check_checkpoint
from lightning_preempt.storage.diagnose import describe
from lightning_preempt.storage.store import Store, files_below, kind_at

log = logging.getLogger(__name__)


_WARNED_FOREIGN: set[str] = set()


def apply_retention(
    url: str,
    keep_last_n: int,
    storage_options: dict[str, Any] | None = None,
    *,
    protect: frozenset[str] = frozenset(),
    run_id: str | None = None,
    check_files: bool = True,
) -> list[str]:
    """Keep the newest ``keep_last_n`` sound committed checkpoints; remove older ones, and our
    corrupt ones and leftovers older than the newest that verifies. Returns the removed URLs.

    * Only our names holding only our files are touched; anything else: one warning.
    * *Sound*: files exist with their sizes; others never count toward ``keep_last_n``.
    * Nothing is removed until one checkpoint verifies in full, and that one is kept.
      ``check_files=False``: committed is sound, the newest committed is that one.
    * ``run_id``: other runs' checkpoints are neither counted nor removed (their ledgers go
      once none is left); ``protect``: never touched; a newer format is never removed.
    * "Could not tell" (EIO, a 503) is raised, never taken for "partial".
    """
    infos = list_checkpoints(url, storage_options)
    _warn_foreign(url, storage_options, infos)
    ours = [c for c in infos if dir_step(c.name) is not None and not _other_run(c, run_id)]
    anchor: CheckpointInfo | None = None
    kept = 0
    doomed: list[tuple[CheckpointInfo, str]] = []
    for info in ours:
        if info.newer_format or info.name in protect:
            continue
        problem = None if info.committed else (info.problem or "not committed")
        if problem is None and check_files:
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
    if run_id is not None:  # the ledgers of runs none of whose checkpoints is left go too
        gone = set(removed)
        prune_ledgers(url, storage_options, run_id=run_id, remaining=[c for c in infos if c.path not in gone])
    return removed


def retain(url: str, keep_last_n: int, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> list[str]:
    """:func:`apply_retention` (the same arguments) for background jobs: a failure is logged,
    never raised (the next commit tries again)."""
    try:
        return apply_retention(url, keep_last_n, storage_options, **kwargs)
    except Exception as err:
        log.warning(
            "lightning_preempt: retention in %s failed (%s)\nHINT: nothing was deleted; check that the storage "
            "is reachable and allows deletes. The next save retries.",
            url, describe(err, storage_options or {}),
        )  # fmt: skip
        return []


def _other_run(info: CheckpointInfo, run_id: str | None) -> bool:
    other = info.manifest.run_id if info.manifest is not None else None
    return run_id is not None and other is not None and other != run_id


def _soundness_problem(info: CheckpointInfo, storage_options: dict[str, Any] | None, *, need_crc: bool) -> str | None:
    """Why a committed checkpoint cannot be counted (``None``: it can). ``need_crc``: it
    would become the newest verified one, so its CRC32C must be known to match."""
    store = Store(info.path, storage_options)
    assert info.manifest is not None
    try:
        if need_crc and not is_verified(info.path, info.manifest):
            check_checkpoint(store, info.manifest, verify=True)
            mark_verified(info.path, info.manifest)
        else:
            check_checkpoint(store, info.manifest, verify="sizes")
    except CheckpointError as err:
        # damage only: "could not tell" (EIO, a 503) is raised, so nothing is deleted as corrupt
        log.warning("lightning_preempt: retention does not count %s: %s", info.path, str(err).splitlines()[0])
        return str(err).splitlines()[0]
    return None


def _warn_foreign(url: str, storage_options: dict[str, Any] | None, infos: list[CheckpointInfo]) -> None:
    """One warning per process and root for what retention will never touch there."""
    if url in _WARNED_FOREIGN:
        return
    try:
        names = [e.name for e in Store(url, storage_options).entries()]
    except Exception:
        return
    foreign = sorted(n for n in names if dir_step(n) is None and not n.startswith(HIDDEN_PREFIX))
    if foreign:
        _WARNED_FOREIGN.add(url)
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        log.warning(
            "lightning_preempt: retention leaves alone what it did not create in %s: %s "
            "(only step-NNNNNNNNNN directories holding its own files are ever deleted)",
            url,
            shown,
        )


def prune_ledgers(
    url: str, storage_options: dict[str, Any] | None, *, run_id: str, remaining: Iterable[CheckpointInfo]
) -> list[str]:
    """Delete the ledgers of runs other than ``run_id`` that no checkpoint in ``remaining``
    (what retention left under ``url``) belongs to; nothing while any checkpoint's run cannot
    be told. Returns the run ids whose ledger went."""
    runs: set[str] = {run_id}
    for info in remaining:
        owner = info.manifest.run_id if info.manifest is not None else None
        if owner is None:
            return []  # a checkpoint whose run cannot be told: it may be any old run's
        runs.add(owner)
    store = ledger_store(url, storage_options)
    if kind_at(store) != "dir":
        return []
    gone = []
    for run in run_ids(store):
        if run in runs:
            continue
        run_store = store.child(run)
        for name in files_below(run_store):
            if LEDGER_RECORD_RE.fullmatch(name) or LEDGER_COMPACT_RE.fullmatch(name):
                run_store.rm_file(name)
        if run_store.is_local:
            with contextlib.suppress(OSError):  # not empty (a file that is not ours): left there
                os.rmdir(run_store.path())
        log.info("lightning_preempt: retention removed the ledger of run %s: none of its checkpoints is left", run)
        gone.append(run)
    return gone
