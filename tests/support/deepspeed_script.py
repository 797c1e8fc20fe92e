"""train_script.py's job under DeepSpeed ZeRO on CPU ranks (deepspeed_cpu.py), with the
PreemptionCallback: the status files of models.py, and after a normal end
``weights.pt`` (rank 0): the full parameters, gathered from the ZeRO partitions."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import warnings
from typing import Any

import lightning as L
import torch
from deepspeed_cpu import CPUDeepSpeedStrategy
from lightning.pytorch.callbacks import Callback
from models import TinyModel, data, fit_reporting
from torch.utils.data import DataLoader
from train_script import SelfSignal

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning


def full_weights(model: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    """Every parameter in full, on every rank (collective under ZeRO-3)."""
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {k: p.detach().clone() for k, p in model.named_parameters()}
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--status", default="")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--signal-at", default=None, help="see train_script.SelfSignal")
    p.add_argument("--signal-rank", type=int, default=None)
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung job's stacks, on demand
    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated collectives, per step

    L.seed_everything(0, workers=True)
    model = TinyModel(width=args.width, status=args.status)
    # heartbeat_timeout_s: DeepSpeed's CPU collectives may spin holding the GIL while the other rank,
    # starved on a loaded 2-core machine, catches up: the 4 s default then declared both ranks lost.
    cb = PreemptionCallback(args.dirpath, every_n_train_steps=args.every, keep_last_n=2, grace_period_s=30.0,
                            tuning=Tuning(heartbeat_timeout_s=30.0))  # fmt: skip
    callbacks: list[Callback] = [cb]
    if args.signal_at:
        callbacks.append(SelfSignal(args.signal_at, args.signal_rank, cb))
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=CPUDeepSpeedStrategy(stage=args.stage),
        callbacks=callbacks,
        plugins=[ShardedAsyncCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
    )
    loader = DataLoader(data(512), batch_size=16, shuffle=False)

    def extra() -> dict[str, Any]:
        weights = full_weights(model, args.stage)
        if trainer.global_rank == 0 and args.status:
            torch.save(weights, os.path.join(args.status, "weights.pt"))
        return {"resumed_from": cb.resumed_from}

    return fit_reporting(trainer, model, args.status, loader, extra=extra)


if __name__ == "__main__":
    sys.exit(main())
