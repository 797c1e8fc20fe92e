"""A user's training script for SLURM, as docs/recipes.md's "SLURM" section shows: the documented API
only (``PreemptionCallback`` + ``ShardedAsyncCheckpointIO``). ``train.sbatch`` runs it with
``srun``; the same command on every (re)start resumes from the newest valid checkpoint.

It prints ``start step N`` when training starts and ``step N`` after each optimizer step, and
writes the final weights with ``torch.save`` to ``--weights`` when training ends (the SLURM
tests compare them bitwise with an uninterrupted run).

A signal that comes after ``trainer.fit`` returned (the time limit's early signal while the
process exits) meets the default SIGTERM action again and kills it: SLURM then records the job
``FAILED`` although training ended. Leave the last run room before its limit.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning


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
    """Prints the step; listed before PreemptionCallback so the step a snapshot is taken at
    is printed too."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:  # one line per run, whatever the number of tasks
            print(f"start step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0:
            print(f"step {trainer.global_step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True, help="checkpoints (any fsspec URL)")
    p.add_argument("--weights", required=True, help="where the final weights go")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--every", type=int, default=20, help="periodic save every N steps")
    p.add_argument("--grace", type=float, default=20.0, help="the partition's GraceTime")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--no-requeue", action="store_true", help="requeue=False (the scheduler decides)")
    p.add_argument("--devices", type=int, default=1, help="processes a node (--ntasks-per-node)")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (under SLURM: --nodes)")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy="ddp" if args.devices * args.num_nodes > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Progress(), PreemptionCallback(dirpath=args.dirpath, every_n_train_steps=args.every,
                                      grace_period_s=args.grace, tuning=Tuning(signals=("SIGUSR1", "SIGTERM"),
                                      requeue=False if args.no_requeue else None))],
        plugins=[ShardedAsyncCheckpointIO()],
    )
    model = Regressor(args.step_sleep)
    trainer.fit(model, loader)  # on every (re)start: resumes from the newest valid checkpoint
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), args.weights)
        print(f"done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
