"""Staging buffers ready before the first save: what the callback calls, and when.

The first save used to allocate its staging buffers itself: first touch of fresh host
memory cost ~12x the copy (and pinning a large shard with CUDA seconds more), inside the
step, or inside the grace period when the first save is the emergency one. The callback
calls :func:`prepare_staging` at ``on_train_start`` (model and restored optimizer state
exist) and again after the first optimizer step (optimizers such as Adam create their
state lazily there); buffers that already fit are kept, so the second call only adds
what the first step created.
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
    """The tensor part of the checkpoint ``trainer.save_checkpoint`` would write now,
    as references (no copy): the same calls Lightning's ``dump_checkpoint`` makes, so
    the keys are those of the real save. ``None`` where that would copy the state
    (``ModelParallelStrategy`` offloads its sharded state dict to CPU to build it).
    """
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
