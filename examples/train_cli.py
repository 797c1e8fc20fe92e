"""LightningCLI entry point: `python examples/train_cli.py fit --config examples/config.yaml`.

The YAML sets up `PreemptionCallback` and `ShardedAsyncCheckpointIO`; every (re)start of
the same command resumes from the newest valid checkpoint. The effective config is saved as
`checkpoints/config.yaml` (``--trainer.default_root_dir`` moves it).
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset


class RegressionModel(L.LightningModule):
    """A small MLP on synthetic data (CPU-friendly)."""

    def __init__(self, width: int = 32, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class SyntheticData(L.LightningDataModule):
    """Deterministic regression data."""

    def __init__(self, n: int = 512, batch_size: int = 16) -> None:
        super().__init__()
        self.n = n
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=self.batch_size)


def main() -> None:
    # LightningCLI saves the effective config into the Trainer's log dir, the working
    # directory by default: keep it under checkpoints/ (git ignores it) instead of beside the
    # code. A requeued job runs the same command again: let it rewrite its saved config.
    LightningCLI(
        RegressionModel,
        SyntheticData,
        trainer_defaults={"default_root_dir": "checkpoints"},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
