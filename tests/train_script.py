"""A small real training job used by the tests (run as a subprocess, also under DDP).

Writes ``rank{R}.pid`` and ``rank{R}.step`` (the global step after each batch) into
``--status`` so a test can signal a chosen rank at a known step, and on exit
``rank{R}.result.json`` with the final step and a digest of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO


class TinyModel(L.LightningModule):
    def __init__(self, width: int = 32, step_sleep: float = 0.0, status: str = "", lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.batches_seen: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.hparams.step_sleep:
            time.sleep(self.hparams.step_sleep)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.hparams.status:
            path = os.path.join(self.hparams.status, f"rank{self.global_rank}.step")
            with open(path + ".tmp", "w") as f:
                f.write(str(self.trainer.global_step))
            os.replace(path + ".tmp", path)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 512, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return TensorDataset(x, y)


def weights_digest(model: torch.nn.Module) -> list[float]:
    return [float(p.detach().double().sum()) for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--status", default="")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--val-every", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--ckpt-path", default=None)
    args = p.parse_args(argv)

    L.seed_everything(0, workers=True)
    model = TinyModel(step_sleep=args.step_sleep, status=args.status)
    cb = PreemptionCallback(args.dirpath, every_n_train_steps=args.every, keep_last_n=3, grace_period_s=args.grace)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        callbacks=[cb],
        plugins=[ShardedAsyncCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0 if not args.val_every else 2,
        val_check_interval=args.val_every or None,
        limit_val_batches=4 if args.val_every else 0,
        deterministic=True,
    )
    if args.status:
        os.makedirs(args.status, exist_ok=True)
        with open(os.path.join(args.status, f"rank{trainer.global_rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    loader = DataLoader(data(), batch_size=args.batch_size, shuffle=False)
    val = DataLoader(data(64, seed=1), batch_size=16)
    trainer.fit(model, loader, val if args.val_every else None, ckpt_path=args.ckpt_path)
    if args.status:
        with open(os.path.join(args.status, f"rank{trainer.global_rank}.result.json"), "w") as f:
            json.dump(
                {"step": trainer.global_step, "weights": weights_digest(model), "resumed_from": cb.resumed_from}, f
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
