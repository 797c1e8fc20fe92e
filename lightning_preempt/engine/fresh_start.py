"""Never a silent fresh start: a run that finds nothing to resume from in a ``dirpath`` where an
earlier run made progress stops before step 1 (docs/design.md, "Never a silent fresh start").

Starting from step 0 there is right for a new run and wrong after a failure: checkpoints that
were written by something other than our plugin (a strategy that bypassed it), a dirpath whose
checkpoints were all damaged or deleted, saves that never committed. Training from 0 would
then overwrite the run's progress with exit 0, and nobody would notice. The evidence:

* checkpoint directories (``step-*``) that hold no committed checkpoint: saves were made;
* the ledger records a committed save to storage (tier 0's copies in host memory do not count:
  losing them with the node is what tier 0 expects, and the disk saves follow).

Progress the run never saved (a SIGKILL before the first save) is no evidence: training from 0
loses nothing then. A user who means to start over says so: ``resume=False``.
"""

from __future__ import annotations

import logging

from lightning_preempt.catalog.ledger_reader import read_ledger
from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.errors import ProgressWouldBeLostError

log = logging.getLogger(__name__)


def earlier_progress(config: PreemptionConfig) -> str | None:
    """What in ``dirpath`` shows that a run made progress there, or ``None``. One rank calls it
    (a listing, and the ledger when no checkpoint directory is left)."""
    listed = list_checkpoints(config.dirpath, config.storage_options)
    if listed:
        names = ", ".join(c.name for c in listed[:3]) + (", ..." if len(listed) > 3 else "")
        return f"{len(listed)} checkpoint director{'y' if len(listed) == 1 else 'ies'} ({names}), none resumable"
    try:
        ledger = read_ledger(config.dirpath, config.storage_options)
    except Exception as err:  # the ledger is a record, not a requirement: never fatal by itself
        log.warning("lightning_preempt: cannot read the ledger in %s: %s", config.dirpath, err)
        return None
    saved = [
        r["step"] for run in ledger.runs.values() for r in run.records
        if r.get("kind") == "save" and r.get("committed_s") is not None and r.get("tier") != "memory"
    ]  # fmt: skip
    if saved:
        return f"the ledger (.lp-ledger) records {len(saved)} committed save(s), up to step {max(saved)}, none left"
    return None


def refuse_if_progress_lost(config: PreemptionConfig, group: pdist.ProcessGroup | None) -> None:
    """Every rank (collective), when nothing resolved: rank 0 looks for :func:`earlier_progress`
    and every rank raises the same :class:`ProgressWouldBeLostError` if it found some."""
    found = agree.decide(lambda: earlier_progress(config), group, what="looking for earlier progress")
    if found is None:
        return
    raise ProgressWouldBeLostError(
        f"nothing to resume from, but an earlier run made progress here: {found}",
        path=config.dirpath,
        hint="Look with `lightning-preempt ls --verify DIR` (and `lightning-preempt report DIR`). To resume, "
        "restore the checkpoints or pass ckpt_path=...; to start over from step 0 on purpose, pass "
        "resume=False (or use a fresh dirpath).",
    )
