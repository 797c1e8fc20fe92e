"""Lightning wiring of the peer replica (:mod:`lightning_preempt.tiers.peer`, docs/peer-replica.md).

``Trainer(callbacks=[PreemptionCallback(..., local_dirpath=...), PeerReplica()])``: after a
preemption snapshot committed on the node-local tier, every rank copies its share to a rank
on another node, in the engine's ``snapshot_hooks`` (before the drain gets the rest of the
grace period); without that engine, in ``on_exception`` of :class:`~lightning_preempt.Preempted`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine.engine import Engine
from lightning_preempt.preemption.controller import Preempted
from lightning_preempt.tiers.peer import ReplicaReport, complete_from_peers, replicate

log = logging.getLogger(__name__)


class PeerReplica(Callback):
    """Copy the preemption snapshot's node-local files to a peer node before exiting.

    Args:
        timeout_s: the longest the transfer may block (its gloo group's timeout); keep it
            inside the grace period.
    """

    def __init__(self, timeout_s: float = 20.0) -> None:
        self.timeout_s = timeout_s
        self.reports: list[ReplicaReport] = []
        self._group: Any = None
        self._hooked: Any = None  # the PreemptionCallback whose snapshot_hooks hold ours
        self._hook: Any = None  # what we registered there: hook(step)
        self._done_step: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_group": None, "_hooked": None, "_hook": None}  # they belong to one fit

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not pdist.is_distributed():
            return
        self._group = pdist.new_gloo_group(timeout_s=self.timeout_s)  # collective: every rank
        self._done_step = None
        engine = self._engine(trainer)
        if engine is not None:
            self._hook = functools.partial(self._after_snapshot, trainer)
            engine.snapshot_hooks.append(self._hook)
            self._hooked = engine
        if engine is None or engine.local_dirpath is None:
            return
        # Before the callback chooses what to resume from (its ``setup`` runs after ours: Lightning
        # orders checkpoint callbacks last): a snapshot that no single survivor holds but the
        # survivors do together is uploaded to ``dirpath`` (tiers/peer.py complete_from_peers).
        try:
            config = engine.config
            complete_from_peers(str(engine.local_dirpath), config.dirpath, config.storage_options, self._group)
        except Exception as err:  # resume then falls back to what the tiers hold
            log.error("lightning_preempt: completing a checkpoint from the survivors' local tiers failed: %s", err)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            if isinstance(exception, Preempted) and self._group is not None and self._done_step is None:
                self._replicate(trainer, trainer.global_step)
        finally:
            self._release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def _release(self) -> None:
        if self._hooked is not None:
            with contextlib.suppress(ValueError):
                self._hooked.snapshot_hooks.remove(self._hook)
            self._hooked = self._hook = None
        group, self._group = self._group, None
        pdist.destroy_group(group)

    def _after_snapshot(self, trainer: pl.Trainer, step: int) -> None:
        if self._group is not None:
            self._replicate(trainer, step)
            self._done_step = step

    @staticmethod
    def _engine(trainer: pl.Trainer) -> Engine | None:
        """The engine of the Trainer's ``PreemptionCallback``, if it has one."""
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            engine = getattr(cb, "engine", None)
            if isinstance(engine, Engine):
                return engine
        return None

    def _replicate(self, trainer: pl.Trainer, step: int) -> None:
        engine = self._engine(trainer)
        root = engine.local_dirpath if engine is not None else None
        if root is None:
            return  # one shared dirpath: every node already reads every file

        def snapshot_name() -> str | None:
            mine = [c for c in list_checkpoints(root, {}) if c.committed and c.step == step]
            return os.path.basename(mine[-1].path.rstrip("/")) if mine else None

        try:
            name = agree.decide(  # a directory name, as JSON: nothing on the replica's path is unpickled
                snapshot_name, self._group, what="finding the snapshot to replicate", json_max_bytes=1 << 16
            )
            if name is None:
                log.warning("lightning_preempt: no committed local snapshot of step %d to replicate", step)
                return
            report = replicate(os.path.join(root, name), self._group)
        except Exception as err:  # the exit goes on: the replica is a second copy, never the only one
            with contextlib.suppress(Exception):
                log.error("lightning_preempt: [preemption] peer replica of step %d failed: %s", step, err)
            return
        self.reports.append(report)
        log.warning(
            "lightning_preempt: [preemption] replicated step %d to a peer node: sent %d B, received %d B "
            "(%d files) in %.2fs; every file is on %d node(s) or more",
            step, report.bytes_sent, report.bytes_received, len(report.files_received), report.seconds,
            min((len(v) for v in report.holders.values()), default=0),
        )  # fmt: skip
