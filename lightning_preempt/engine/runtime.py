"""What one run holds and releases (its gloo groups, the lease) and the checks the engine
makes once at start-up (the storage probe, the newest manifest, warnings about the interval)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.engine.tier_policy import newest_disk_step
from lightning_preempt.errors import CheckpointError
from lightning_preempt.format.manifest import Manifest
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

    def take_lease(self, config: PreemptionConfig, *, leader: bool) -> None:
        """Rank 0 takes the lease on ``dirpath`` (a heartbeat thread); every rank gets the outcome."""
        lease = Lease(config.dirpath, config.storage_options, timeout_s=config.lease_timeout_s)
        if leader:
            self.lease = lease

        def take() -> None:
            lease.acquire()
            lease.start_heartbeat()

        agree.decide(take, self.agree_group, what="taking the lease on dirpath")

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


def listed_at_setup(config: PreemptionConfig) -> tuple[Manifest | None, int | None]:
    """What ``dirpath`` holds as training starts: its newest committed manifest (for the grace
    projection) and the highest step any of its checkpoint directories carries (-1: none; a
    save of a higher step has a fresh path without asking the storage, engine/tier_policy.py).
    A failed listing is logged, never fatal: ``(None, None)``."""
    try:
        listed = list_checkpoints(config.dirpath, config.storage_options)
    except Exception as err:
        log.warning("lightning_preempt: cannot read the newest manifest for the grace check: %s", err)
        return None, None
    newest = next((c for c in listed if c.committed), None)
    return (newest.manifest if newest is not None else None), max((c.step for c in listed), default=-1)


def warn_about_newer_checkpoints(config: PreemptionConfig, step: int) -> None:
    """A run resumed from a path the user gave, at ``step``: warn when ``dirpath`` holds a
    newer checkpoint (after a preemption auto-resume would take that one)."""
    newest = newest_disk_step(config, None)  # -1 when the listing fails: a warning only, never fatal
    if newest > step:
        warnings.warn(
            f"lightning_preempt: resumed from step {step} but {config.dirpath} holds a newer checkpoint "
            f"(step {newest}); after a preemption auto-resume takes the newest step.\n"
            "HINT: use a fresh dirpath for a run that branches off an older checkpoint.",
            stacklevel=3,  # the front-end hook that started training
        )


def warn_without_periodic_saves(config: PreemptionConfig, step: int) -> None:
    """Warn when neither ``every_n_train_steps`` nor ``every_n_seconds`` is set: only the end of
    training and a preemption signal save, so a SIGKILL loses everything since ``step``."""
    if config.every_n_train_steps is not None or config.every_n_seconds is not None:
        return
    signals = "/".join(s.name for s in config.signums)
    end = "the end of training and " if config.save_on_train_end else ""
    warnings.warn(
        f"lightning_preempt: no periodic saves (every_n_train_steps=None, every_n_seconds=None): {config.dirpath} "
        f"gets a checkpoint only at {end}a preemption signal ({signals}, snapshot within grace_period_s="
        f"{config.grace_period_s:g}); a SIGKILL, a crash or a preemption without grace loses every step since "
        f"step {step}.\nHINT: set every_n_train_steps=N or every_n_seconds=S (every_n_seconds=1800 loses at most "
        "30 minutes); `lightning-preempt plan --state-bytes SIZE --mtbf DURATION` suggests an interval.",
        stacklevel=3,  # the front-end hook that started training
    )
