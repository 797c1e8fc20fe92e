"""Staging under the Trainer. Buffers ready before the first save (first touch of fresh host
memory costs ~12x the copy, inside a step or the grace period): prepared at ``on_train_start``
and again after the first optimizer step (Adam creates its state there). Overlapped staging
(staging/overlap.py): which tensors only an optimizer step changes, and the hooks where other
code may change them, where the copy in flight is settled: before each optimizer step, at
validation start (``WeightAveraging`` swaps weights there), at epoch and training end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
from typing_extensions import override

from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

log = logging.getLogger(__name__)


def checkpoint_like(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The tensor part of the checkpoint ``trainer.save_checkpoint`` would write now, as
    references (``dump_checkpoint``'s calls); ``None`` where that would copy the state."""
    strategy = trainer.strategy
    # (DeepSpeed saves its own state: nothing of ours is staged)
    if isinstance(strategy, (ModelParallelStrategy, DeepSpeedStrategy)) or trainer.lightning_module is None:
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


def stable_tensors(trainer: pl.Trainer) -> Iterator[torch.Tensor]:
    """The tensors only an optimizer step changes: parameters and optimizer state."""
    module = trainer.lightning_module
    if module is not None:
        yield from module.parameters()
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class OverlapGate(Callback):
    """Settles ``io``'s overlapped copy at the hooks named in the module docstring; first among
    the callbacks, so it settles before another callback's hook of the same name runs."""

    def __init__(self, io: ShardedAsyncCheckpointIO) -> None:
        self.io = io

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.io.saver.settle()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.io.saver.settle()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.io.saver.settle()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.io.saver.settle()


def install(trainer: pl.Trainer, io: ShardedAsyncCheckpointIO) -> None:
    """Declare the stable tensors to ``io``'s saver and put the gate first among the
    callbacks, when ``io`` overlaps staging."""
    overlap = io.saver.overlap
    if not overlap.enabled:
        return
    overlap.stable = lambda: stable_tensors(trainer)
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(c, OverlapGate) and c.io is io for c in callbacks):
        callbacks.insert(0, OverlapGate(io))
