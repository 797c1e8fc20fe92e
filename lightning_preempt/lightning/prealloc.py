"""Staging buffers ready before the first save (first touch of fresh host memory costs ~12x
the copy, inside a step or the grace period). Called at ``on_train_start`` and again after
the first optimizer step (Adam creates its state there); buffers that fit are kept.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

log = logging.getLogger(__name__)


def checkpoint_like(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The tensor part of the checkpoint ``trainer.save_checkpoint`` would write now, as
    references (``dump_checkpoint``'s calls); ``None`` where that would copy the state."""
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy) or trainer.lightning_module is None:
        return None
    return {
        "state_dict": strategy.lightning_module_state_dict(),
        "optimizer_states": [strategy.optimizer_state(opt) for opt in trainer.optimizers],
    }


def prepare_staging(trainer: pl.Trainer, io: ShardedAsyncCheckpointIO) -> Future[int] | None:
    """Allocate and touch ``io``'s staging buffers for ``trainer``'s state on a background
    thread (returns at once). Every rank calls it; it is not collective."""
    like = checkpoint_like(trainer)
    if like is None:
        return None
    try:
        return io.prepare_staging(like, background=True)
    except Exception as err:  # never fail training over a head start
        log.warning("lightning_preempt: could not preallocate staging buffers: %s", err)
        return None
