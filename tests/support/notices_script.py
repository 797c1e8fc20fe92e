"""The tests' training job (tests/train_script.py's model and data) with cloud notices on.

Endpoints come from the environment (``LP_NOTICES_AWS_ENDPOINT`` …, pointed at
tests/fake_metadata.py by the test), as a user's job would get them. Writes the same status
files as train_script.py: ``rank{R}.step`` after each batch, ``rank{R}.exit`` and, after a
normal end, ``rank{R}.result.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from models import TinyModel, data, fit_reporting
from torch.utils.data import DataLoader

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning


class StepTimer(Callback):
    """Seconds per step after a warm-up (for benchmarks/bench_notices.py-style comparisons)."""

    def __init__(self, warmup: int = 50) -> None:
        self.warmup, self.t0, self.s_per_step = warmup, 0.0, 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.t0 = time.perf_counter()
        elif trainer.global_step > self.warmup:
            self.s_per_step = (time.perf_counter() - self.t0) / (trainer.global_step - self.warmup)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--notices", default=None, help="comma-separated names, or 'auto'")
    p.add_argument("--on-notice", default="continue")
    p.add_argument("--local-dirpath", default=None, help="two-tier mode: node-local tier")
    args = p.parse_args()

    L.seed_everything(0, workers=True)
    model = TinyModel(step_sleep=args.step_sleep, status=args.status)
    cb = PreemptionCallback(
        args.dirpath,
        every_n_train_steps=args.every,
        keep_last_n=5,
        grace_period_s=args.grace,
        notices=args.notices.split(",") if args.notices else None,
        local_dirpath=args.local_dirpath,
        tuning=Tuning(on_notice=args.on_notice),
    )
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        callbacks=[cb, timer := StepTimer()],
        plugins=[ShardedAsyncCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
    )
    loader = DataLoader(data(), batch_size=16, shuffle=False)
    return fit_reporting(trainer, model, args.status, loader, extra=lambda: {"s_per_step": timer.s_per_step})


if __name__ == "__main__":
    sys.exit(main())
