"""A user's training script for a Kubernetes Job (``job.yaml`` beside it, docs/recipes.md's
"Kubernetes"): the documented API only (``PreemptionCallback`` + ``ShardedAsyncCheckpointIO``).
Every (re)started pod runs the same command and resumes from the newest valid checkpoint.

On SIGTERM (the kubelet's, when the pod is preempted, evicted or its node drained) every rank
snapshots the agreed step, waits for the commit and the process exits 143, which the Job's
``podFailurePolicy`` ignores: a replacement pod starts without counting a failure. It prints
``start step N`` when training starts and ``step N`` after each optimizer step.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.step_sleep = step_sleep
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep)  # stands for a real step's compute
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Progress(L.Callback):
    """Prints the step (listed before PreemptionCallback, so the snapshot's step is printed too)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        print(f"start step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        print(f"step {trainer.global_step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True, help="checkpoints: storage that outlives the pod (gs://, s3://, a PVC)")
    p.add_argument("--grace", type=float, required=True, help="the pod's terminationGracePeriodSeconds")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--every", type=int, default=500, help="periodic save every N steps")
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=16, shuffle=True)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            Progress(),
            PreemptionCallback(dirpath=args.dirpath, every_n_train_steps=args.every, grace_period_s=args.grace),
        ],
        plugins=[ShardedAsyncCheckpointIO()],
    )
    trainer.fit(Regressor(args.step_sleep), loader)  # on every (re)start: resumes from the newest valid checkpoint


if __name__ == "__main__":
    main()
