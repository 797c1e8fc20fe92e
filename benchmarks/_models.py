"""The benchmarks' training job pieces: a stack of square ``Linear`` layers sized in MiB and
a noise dataset. Imports Lightning: only the child processes that train import this module."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import Dataset


class Big(L.LightningModule):
    """``n_layers`` bias-free ``width x width`` layers, SGD (``momentum`` adds a buffer per weight)."""

    def __init__(self, width: int, n_layers: int, lr: float, momentum: float = 0.0) -> None:
        super().__init__()
        self.lr, self.momentum = lr, momentum
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n_layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out: torch.Tensor = self.net(batch).pow(2).mean()
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Noise(Dataset[torch.Tensor]):
    """A million rows of ``width`` values (``i % 7``): deterministic, no I/O."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.ones(self.width) * (i % 7)
