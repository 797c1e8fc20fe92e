"""The engine's two-tier decisions (docs/two-tier.md).

The mechanism (local commit, drain queue, per-tier retention) lives in tiers/two_tier.py; these
are the policy decisions around it: wiring the saver's tiers, uploading on start what only
this node holds, where the "already taken" check looks (and so the path of a new save), and
how long an emergency snapshot may drain.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from lightning_preempt.catalog.listing import complete_local_checkpoints, list_checkpoints
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage.diagnose import describe
from lightning_preempt.storage.store import Store, join_url
from lightning_preempt.tiers.two_tier import TwoTier

log = logging.getLogger(__name__)


def configure_tiers(
    saver: Saver, *, dirpath: str, local_dirpath: str | None, keep_last_n: int,
    new_group: Callable[[], pdist.ProcessGroup | None],
) -> str | None:  # fmt: skip
    """Give the saver its tiers: the remote root, retention, and a gloo group for the drain
    thread. Collective when tiers are on (every rank configures alike). Returns the local
    tier in use (the engine's ``local_dirpath`` or the plugin's)."""
    tiers = saver.tiers
    if local_dirpath is not None and tiers is None:
        saver.use_local_tier(local_dirpath)
    elif tiers is not None and local_dirpath is None:
        local_dirpath = tiers.local_root
    elif tiers is not None and tiers.local_root != str(local_dirpath).rstrip("/"):
        raise ValueError(
            f"local_dirpath differs: {local_dirpath!r} (callback) vs {tiers.local_root!r} (plugin)\n"
            "HINT: pass the same local_dirpath to both, or to one of them."
        )
    if saver.tiers is None:
        return local_dirpath
    drain_group = new_group()
    collective = pdist.is_distributed() and saver.group is not None
    saver.tiers.configure(dirpath, keep_last_n, drain_group if collective else None)
    return local_dirpath


def upload_local_only(tiers: TwoTier, dirpath: str) -> None:
    """Rank 0: queue the upload of the newest checkpoint only this node's disk holds (before
    any retention of the remote tier runs: drains run in order)."""
    try:
        pending = tiers.local_only()
    except Exception as err:
        log.warning("lightning_preempt: cannot compare the tiers (%s); no upload on start", err)
        return
    if not pending:
        return
    newest = pending[-1]
    remote_url = tiers.remote_twin(newest.path)
    if remote_url is None:
        return
    log.info("lightning_preempt: %s (step %d) is committed locally but not in %s: uploading it", newest.path,
             newest.step, dirpath)  # fmt: skip
    tiers.queue_drain(newest.path, remote_url, newest.step, solo=True)


def taken(tiers: TwoTier | None, path: str, storage_options: dict[str, Any]) -> bool:
    """Does ``path`` already hold a committed checkpoint? With two tiers the training thread
    looks at the local disk only (a remote outage must not stall a step)."""
    try:
        if tiers is None:
            return Store(path, storage_options).stat(MANIFEST_NAME) is not None
        local = tiers.local_twin(path)
        return local is not None and tiers.committed(local)
    except Exception as err:  # could not tell: a fresh name, so nothing committed is ever replaced
        log.warning("lightning_preempt: cannot tell whether %s is committed (%s); saving beside it", path,
                    describe(err, storage_options))  # fmt: skip
        return True


def fresh_path(tiers: TwoTier | None, dirpath: str, step: int, storage_options: dict[str, Any], group: Any,
               *, highest_listed: int | None = None) -> str:  # fmt: skip
    """``dirpath/step-N``, or a suffixed sibling when a committed ``step-N`` exists (a run
    resumed from an older checkpoint re-reaches a step). Rank 0 decides for all ranks.

    ``highest_listed``: the highest step ``dirpath`` held when training started (agreed by
    every rank; None: unknown). One tier and a higher step: ``step-N`` is fresh, decided by
    every rank alike without a storage round trip or a collective (a bucket's HEAD on the
    training thread at every save). Only another job writing the same ``dirpath`` could have
    made it since, which the lease refuses; and the writer never tears what it replaces."""
    path = join_url(dirpath, checkpoint_name(step))
    if tiers is None and highest_listed is not None and step > highest_listed:
        return path

    def pick() -> str:
        if not taken(tiers, path, storage_options):
            return path
        return join_url(dirpath, checkpoint_name(step, suffix=uuid.uuid4().hex[:8]))

    return agree.decide(pick, group, what="choosing the checkpoint path")


def drain_within_grace(
    saver: Saver, *, dirpath: str, step: int, budget: float, mark: Callable[[str], None],
    saved: tuple[str, int | None] | None,
) -> str:  # fmt: skip
    """Two tiers: let the snapshot drain for ``budget`` seconds. Returns "; step N held by …"
    for the exit log when ``saved`` (path, step: rank 0's last save) is given."""
    if saver.tiers is None:
        return ""
    mark(f"draining step {step} to {dirpath} for at most {budget:.1f}s")
    finished = saver.wait_drained(budget)
    mark("drained" if finished else "drain did not finish within the grace period")
    if saved is None:
        return ""
    held = saver.tiers.holders(saved[0])
    return f"; step {saved[1]} held by: {', '.join(held) or 'no tier (see the errors above)'}"


def newest_disk_step(config: Any, tiers: TwoTier | None) -> int:
    """The newest committed step on the disk tiers (``dirpath``, and the local tier when it
    holds whole checkpoints), -1 when none or when the listing fails (the resolver lists
    again and reports it): tier 0's restore from peers is skipped when it is not newer."""
    try:
        steps = [c.step for c in list_checkpoints(config.dirpath, config.storage_options) if c.committed]
        if tiers is not None and tiers.single_host:
            steps += [c.step for c in complete_local_checkpoints(tiers.local_root)]
    except Exception as err:
        log.debug("lightning_preempt: cannot list the disk tiers for tier 0's restore: %s", describe(err, {}))
        return -1
    return max(steps, default=-1)
