"""Overlapped staging under the Trainer (staging/overlap.py): which tensors only an optimizer
step changes, and the hooks where other code may change them, where the copy in flight is
settled: before each optimizer step, at validation start (``WeightAveraging`` swaps weights
there), at epoch and training end. :class:`OverlapGate` goes first among the callbacks so it
settles before another callback's hook of the same name runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO


def stable_tensors(trainer: pl.Trainer) -> Iterator[torch.Tensor]:
    """The tensors only an optimizer step changes: parameters and optimizer state."""
    module = trainer.lightning_module
    if module is not None:
        yield from module.parameters()
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class OverlapGate(Callback):
    """Settles ``io``'s overlapped copy at the hooks named in the module docstring."""

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


def install(trainer: pl.Trainer, io: ShardedAsyncCheckpointIO) -> bool:
    """Declare the stable tensors to ``io``'s saver and put the gate first among the
    callbacks, when ``io`` overlaps staging. Returns whether it does."""
    overlap = io.saver.overlap
    if not overlap.enabled:
        return False
    overlap.stable = lambda: stable_tensors(trainer)
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(c, OverlapGate) and c.io is io for c in callbacks):
        callbacks.insert(0, OverlapGate(io))
    return True
