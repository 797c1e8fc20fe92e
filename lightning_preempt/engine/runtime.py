"""What one run of the engine holds and releases: its process groups and the lease, and the
set-up steps that take them (the storage probe, the lease)."""

from __future__ import annotations

import logging
from typing import Any

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.errors import CheckpointError
from lightning_preempt.save.lease import Lease
from lightning_preempt.save.preflight import check_writable

log = logging.getLogger(__name__)


class Runtime:
    """The gloo groups and the lease of one run (never pickled; released by :meth:`release`)."""

    def __init__(self) -> None:
        self.groups: list[pdist.ProcessGroup] = []
        self.agree_group: pdist.ProcessGroup | None = None
        self.lease: Lease | None = None

    def new_group(self) -> pdist.ProcessGroup | None:
        """A gloo group of our own (collective: every rank calls it, in the same order)."""
        group = pdist.new_gloo_group()
        if group is not None:
            self.groups.append(group)
        return group

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        for group in self.groups:
            pdist.destroy_group(group)
        self.groups.clear()
        self.agree_group = None


def preflight(dirpath: str, storage_options: dict[str, Any], local_dirpath: str | None, group: Any) -> None:
    """Every rank writes, lists and deletes a probe file in ``dirpath``: fail before step 1, alike.

    The local tier is probed too, but a failure there only warns: saves then go straight
    to ``dirpath`` (docs/two-tier.md), which is slower but loses nothing."""
    agree.agree(lambda: check_writable(dirpath, storage_options), group, what="probing the storage")
    if local_dirpath is None:
        return
    try:
        agree.agree(lambda: check_writable(local_dirpath, {}), group, what="probing the local tier")
    except CheckpointError as err:
        log.warning("lightning_preempt: %s\nSaves will be written directly to %s.", err, dirpath)


def take_lease(rt: Runtime, config: PreemptionConfig, *, leader: bool) -> None:
    """Rank 0 takes the lease on ``dirpath`` (a heartbeat thread); every rank gets the outcome."""
    lease = Lease(config.dirpath, config.storage_options, timeout_s=config.lease_timeout_s)
    if leader:
        rt.lease = lease

    def take() -> None:
        lease.acquire()
        lease.start_heartbeat()

    agree.decide(take, rt.agree_group, what="taking the lease on dirpath")
