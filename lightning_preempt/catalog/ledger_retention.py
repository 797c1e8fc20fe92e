"""Old runs' ledgers follow retention: once none of a run's checkpoints is left, its ledger
goes too. Nothing is deleted while any checkpoint's run cannot be told, never the current run's.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from typing import Any

from lightning_preempt.catalog.ledger_reader import ledger_store, run_ids
from lightning_preempt.catalog.listing import CheckpointInfo
from lightning_preempt.format.names import LEDGER_COMPACT_RE, LEDGER_RECORD_RE

log = logging.getLogger(__name__)


def prune_ledgers(
    url: str, storage_options: dict[str, Any] | None, *, run_id: str, remaining: Iterable[CheckpointInfo]
) -> list[str]:
    """Delete the ledgers of runs other than ``run_id`` that no checkpoint in ``remaining``
    (what retention left under ``url``) belongs to. Returns the run ids whose ledger went."""
    runs: set[str] = {run_id}
    for info in remaining:
        owner = info.manifest.run_id if info.manifest is not None else None
        if owner is None:
            return []  # a checkpoint whose run cannot be told: it may be any old run's
        runs.add(owner)
    store = ledger_store(url, storage_options)
    if not store.isdir():
        return []
    gone = []
    for run in run_ids(store):
        if run in runs:
            continue
        run_store = store.child(run)
        for name in run_store.list_files():
            if LEDGER_RECORD_RE.fullmatch(name) or LEDGER_COMPACT_RE.fullmatch(name):
                run_store.rm_file(name)
        if run_store.is_local:
            with contextlib.suppress(OSError):  # not empty (a file that is not ours): left there
                os.rmdir(run_store.path())
        log.info("lightning_preempt: retention removed the ledger of run %s: none of its checkpoints is left", run)
        gone.append(run)
    return gone
