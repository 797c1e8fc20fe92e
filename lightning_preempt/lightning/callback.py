"""The Lightning Trainer front-end: maps the Trainer's hooks onto the engine (engine/engine.py).

Only what is Lightning's alone lives here: the route into ``fit``'s checkpoint resolution
(docs/design.md, "Auto-resume"), the plugin, the strategies' saves, and the loggers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from typing_extensions import override

from lightning_preempt.engine import deprecated as deprecated_names
from lightning_preempt.engine.config import PreemptionConfig, Tuning
from lightning_preempt.engine.engine import Engine
from lightning_preempt.lightning import _compat, sharded_saves, staging_hooks
from lightning_preempt.lightning.checkpoint_io import PREEMPTION_GUARDS, ShardedAsyncCheckpointIO
from lightning_preempt.lightning.exact import STATE_KEY, ExactResume
from lightning_preempt.lightning.logs import (
    NOT_RESUMABLE_LOADER,
    PointerNames,
    QuietWarning,
    SaveReporter,
    quiet_auto_resume_warnings,
    report_resume,
)
from lightning_preempt.lightning.strategies import ensure_plugin, give_ddp_bucket_layout, install_collective_saves
from lightning_preempt.preemption.controller import Preempted
from lightning_preempt.preemption.signals import SignalFlag, shield_workers
from lightning_preempt.preemption.sources import PreemptionSource
from lightning_preempt.save.order import SaveOrder

__all__ = ["Preempted", "PreemptionCallback"]

log = logging.getLogger(__name__)


class EngineViews:
    """What both front-ends (this callback, Fabric's ``Preemption``) show of their engine (the
    rest: ``self.engine``)."""

    engine: Engine

    @property
    def config(self) -> PreemptionConfig:
        return self.engine.config

    @property
    def timeline(self) -> list[tuple[str, float]]:
        """``(event, time.monotonic())`` of the preemption sequence, in order."""
        return self.engine.controller.timeline

    @property
    def resumed_from(self) -> str | None:
        """The checkpoint this run resumed from (after any fall-back), if any."""
        return self.engine.resumed_from


class PreemptionCallback(EngineViews, OnExceptionCheckpoint):
    """Periodic async checkpoints, a snapshot on preemption, and resume on restart.

    Add it with :class:`ShardedAsyncCheckpointIO` to the ``Trainer`` (it installs the plugin
    when none is configured, and hands the plugin its ``storage_options``, ``local_dirpath``
    and ``tuning``); ``trainer.fit(model)`` then resumes from the newest valid checkpoint in
    ``dirpath`` on every (re)start. What each option means, and its default, is written once:
    :class:`~lightning_preempt.engine.config.PreemptionConfig` for the options below and
    :class:`~lightning_preempt.Tuning` for ``tuning`` (docs/options.md). Every option is
    validated here, with a HINT; 0.2's spellings (``**deprecated``) still map to these, with a
    ``FutureWarning`` naming the new one (engine/deprecated.py).
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int | None = None,
        every_n_seconds: float | None = None,
        keep_last_n: int = 2,
        *,
        storage_options: dict[str, Any] | None = None,
        local_dirpath: str | None = None,
        tier0_every_n_steps: int | Literal["auto"] | None = None,
        notices: str | Sequence[str | PreemptionSource] | None = None,
        grace_period_s: float = 30.0,
        resume: bool = True,
        tuning: Tuning | None = None,
        **deprecated: Any,
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "tuning", "deprecated", "__class__")}
        old = deprecated_names.callback_names(**deprecated)
        config = deprecated_names.front("PreemptionCallback", options, tuning, old)
        super().__init__(dirpath=config.dirpath)
        self.engine = Engine(config)
        self.exact = ExactResume(global_batch=config.global_batch)  # RNG, data position, metric states; `.enabled = False` turns it off
        _compat.allow_with_disabled_checkpointing(PreemptionCallback)  # Trainer(enable_checkpointing=False) works
        _compat.quiet_ckpt_path_choice(PreemptionCallback, quiet_auto_resume_warnings)  # only for our Trainers
        self._reporter = SaveReporter(self.engine)
        self._pointer: str | None = None
        self._names = PointerNames()  # Lightning's log names the checkpoint, not the pointer
        # Lightning's "dataloader is not resumable", from on_train_start to the first batch
        # of a resume whose loader positions exact resume restored (ExactResume.positions_restored)
        self._quiet_loader = QuietWarning(NOT_RESUMABLE_LOADER, PossibleUserWarning)
        self._restored_state: dict[str, Any] | None = None
        self._prepare_after: int | None = None  # the step after which staging is prepared again

    @property
    def signal_flag(self) -> SignalFlag:
        return self.engine.controller.signal_flag

    def __getstate__(self) -> dict[str, Any]:
        fresh = {"_pointer": None, "_names": PointerNames()}  # they belong to one fit
        return {**self.__dict__, **fresh, "_quiet_loader": QuietWarning(NOT_RESUMABLE_LOADER, PossibleUserWarning)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # A ddp_spawn worker (a fresh process) unpickles the callback, and Lightning chooses
        # fit's checkpoint path there: the wrapper that quiets its "last" warnings goes too.
        _compat.quiet_ckpt_path_choice(PreemptionCallback, quiet_auto_resume_warnings)

    # ---- auto-resume: Lightning reads this before any hook (docs/design.md) -------------
    @property
    @override
    def ckpt_path(self) -> str | None:  # type: ignore[override]
        """Read by Lightning when ``fit()`` gets no ``ckpt_path``: a local pointer file when
        ``dirpath`` holds a committed checkpoint. In :meth:`setup` every rank agrees on the
        checkpoint and the plugin maps the pointer to it; Lightning's log then names it."""
        if not self.engine.peek():
            return None
        return self._make_pointer()

    def _make_pointer(self) -> str:
        if self._pointer is None:
            fd, self._pointer = tempfile.mkstemp(prefix="lightning_preempt-resume-", suffix=".pointer")
            with os.fdopen(fd, "w") as f:
                f.write(self.config.dirpath)
        return self._pointer

    @property
    def best_model_path(self) -> str:
        """Lightning's ``ckpt_path="best"`` reads this from the first checkpoint callback."""
        return ""

    @best_model_path.setter
    def best_model_path(self, value: str) -> None:
        # ddp_spawn hands the workers' best path back to the first checkpoint callback
        # (launchers/multiprocessing.py); this callback keeps no "best": ignore it.
        pass

    # ---- set-up --------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _compat.tolerate_preempted_children(self.config.exit_code, self.config.grace_period_s)
        if self.exact.enabled:  # DDP is built after the load: its first step reduces as the saved run's
            give_ddp_bucket_layout(trainer.strategy, self.exact.ddp_layout)
        io = ensure_plugin(trainer.strategy, self.config)
        target = self.engine.setup(
            io.saver, save=functools.partial(_save, trainer), leader=trainer.is_global_zero,
            local_rank=trainer.local_rank,
            route_saves=lambda group: install_collective_saves(trainer.strategy, io, group),
            verify_on_load=io.config.verify_on_load,
        )  # fmt: skip
        if target is not None:
            # No pointer: Lightning was told "no checkpoint" before this job held the lease, and
            # the job it waited for committed meanwhile. Loaded here, through the same pointer.
            late = self._pointer is None
            pointer = self._make_pointer()
            # A sealed tier-0 copy is read straight into the parameters (read/tensors.py):
            # no tensor of its own to fault in, and Lightning's copy into the model is a no-op.
            io.alias(pointer, target.path, fallback=target.fallback, into=functools.partial(_model_tensors, pl_module))
            self._names.install(pointer, target.path)
            if late:  # the ranks' peeks may differ (a commit between them): all load at one point
                _compat.restore_late(trainer, pointer)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint: why it was taken (read back to report steps lost)."""
        notice = self.engine.controller.notice
        order = self.engine.saving  # None: a save of ModelCheckpoint's or the user's
        kind = order.kind if order is not None else "periodic"
        return {"kind": kind, "signal": notice.source if notice is not None else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_state = dict(state_dict)

    # ---- training-time hooks -----------------------------------------------------------
    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.engine.controller.start()  # Lightning installed its own handler just before the run stage

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        io = self._plugin(trainer)
        sharded_saves.check_sharding(trainer.strategy)  # the model is wrapped now: its state must be DTensors
        # Staging buffers allocated and touched in the background now: the first (maybe the
        # emergency) save only copies. Again after the first step: optimizer state appears there.
        self._prepare_after = trainer.global_step if staging_hooks.prepare_staging(trainer, io) is not None else None
        staging_hooks.install(trainer, io)  # parameters and optimizer state may be copied while the next step runs
        report_resume(trainer, self._restored_state, log_metrics=self.config.log_metrics)
        # The checkpoint is loaded: the pointer has served. Removed now, not at teardown,
        # which a preempted process never reaches (one file in /tmp per preemption).
        self._drop_pointer()
        self.engine.start(trainer.global_step, loaded_from=io.loaded_from)
        # Loader workers ignore the preemption signals (a group-wide SIGTERM would end them and
        # fail the trainer before its snapshot): effective in the iterators exact resume remakes.
        shield_workers(_compat.train_loaders(trainer), self.engine.config.signums)
        self.exact.on_train_start(trainer, pl_module)  # last: restores RNG just before the first fetch
        if self.exact.positions_restored:
            # Lightning warns when its epoch loop restarts (after this hook, before the first
            # batch) that the loaders cannot resume: we just resumed them. Until the first batch.
            self._quiet_loader.install()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._quiet_loader.remove()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        shield_workers(_compat.train_loaders(trainer), self.engine.config.signums)  # reloaded loaders
        self.exact.on_train_epoch_start(trainer)  # notes the states this epoch's data order is made from

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.exact.on_train_batch_end(trainer)
        io = self._plugin(trainer)
        if self.config.log_metrics:
            self._reporter.report(trainer, io.history)
        if self._prepare_after is not None and trainer.global_step > self._prepare_after:
            self._prepare_after = None
            staging_hooks.prepare_staging(trainer, io)
        self.engine.step_end(trainer.global_step)

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        self.engine.check(trainer.global_step)  # validation and the sanity check can be long: agree here too

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.engine.finish(trainer.global_step)
        if self.config.log_metrics:
            self._reporter.report(trainer, self._plugin(trainer).history)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.exact.on_save_checkpoint(trainer, pl_module, checkpoint)  # per-rank: RNG, data position, metrics

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.exact.load(checkpoint.get(STATE_KEY))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Unlike OnExceptionCheckpoint we save nothing here: after an arbitrary error the
        # state may be inconsistent. Lightning calls no `teardown` hook after an exception:
        # the committed saves are finished and everything is released here.
        self.engine.close(finish_saves=True, error=exception)
        self._drop_pointer()
        self._quiet_loader.remove()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.engine.close()
        self._drop_pointer()
        self._quiet_loader.remove()  # a resume that ended before its first batch

    def _drop_pointer(self) -> None:
        self._names.remove()
        if self._pointer is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._pointer)
            self._pointer = None

    @staticmethod
    def _plugin(trainer: pl.Trainer) -> ShardedAsyncCheckpointIO:
        io = trainer.strategy.checkpoint_io
        assert isinstance(io, ShardedAsyncCheckpointIO)
        return io


def _save(trainer: pl.Trainer, order: SaveOrder) -> None:
    """The engine's save: ``order`` travels as ``storage_options``, which Lightning's strategy hands
    to the plugin unchanged (docs/design.md "A save, hop by hop"). Always the full state (resume
    checkpoints), said explicitly: Lightning then does not log "`weights_only` was not set"."""
    trainer.save_checkpoint(order.url, weights_only=False, storage_options=order)


def _model_tensors(module: pl.LightningModule) -> dict[str, Any]:
    """The module's parameters and buffers by the checkpoint's reference keys (format/skeleton.py)."""
    try:
        state = module.state_dict(keep_vars=True)
    except Exception as err:  # a user's state_dict hook: the load then reads into tensors of its own
        log.debug("lightning_preempt: not reading into the parameters (%s: %s)", type(err).__name__, err)
        return {}
    return {f"state_dict/{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)}


PREEMPTION_GUARDS.append(PreemptionCallback)  # the plugin without one warns at fit's set-up
