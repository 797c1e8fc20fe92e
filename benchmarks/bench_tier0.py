"""Tier 0 (docs/tier0.md): the step-time cost of copying to /dev/shm every K steps, and the
restart time from /dev/shm vs from the disk tier.

One process, CPU, a model of ``--mb`` MB of parameters (Adam: three times that in the state),
``--step-sleep`` seconds of "compute" per step. Step time: the mean interval between
``on_train_batch_end`` calls after the first 3 steps. Restart: a fresh Trainer resuming the
same directories, from the ``fit`` call to the first step (set-up, choice and load; Python's
imports are already done). The disk tier is a directory under ``--disk`` (page cache included: on a real restart
on a new process the disk read may be colder, the tmpfs never is).

    python benchmarks/bench_tier0.py --mb 64 --steps 30 --step-sleep 0.05
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any

import lightning as L
import torch
from _common import machine_notes, table
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO


class Model(L.LightningModule):
    def __init__(self, mb: int, step_sleep: float) -> None:
        super().__init__()
        n = int((mb * 2**20 / 4) ** 0.5)
        self.net = torch.nn.Linear(n, n, bias=False)
        self.step_sleep = step_sleep

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_sleep)
        (x,) = batch
        return self.net(x[:, : self.net.in_features]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Clock(Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []
        self.fit_start = self.first_step = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.first_step:
            self.first_step = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def fit(args: argparse.Namespace, dirpath: str, memory: str | None, steps: int) -> tuple[Clock, PreemptionCallback]:
    cb = PreemptionCallback(dirpath, every_n_train_steps=args.every, keep_last_n=2, lease=False, ledger=False,
                            log_metrics=False, tier0_every_n_steps=args.k if memory else None,
                            memory_dirpath=memory)  # fmt: skip
    clock = Clock()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[cb, clock], logger=False,
                        plugins=[ShardedAsyncCheckpointIO()], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    n = int((args.mb * 2**20 / 4) ** 0.5)
    loader = DataLoader(TensorDataset(torch.randn(steps * 4 + 8, n)), batch_size=4)
    clock.fit_start = time.perf_counter()
    trainer.fit(Model(args.mb, args.step_sleep), loader)
    return clock, cb


def step_s(clock: Clock) -> float:
    """The mean step time after the first 3 steps (a copy every K steps is amortised in it)."""
    gaps = [b - a for a, b in zip(clock.ends[3:], clock.ends[4:], strict=False)]
    return statistics.fmean(gaps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--k", type=int, default=5, help="tier 0 every K steps")
    p.add_argument("--every", type=int, default=1000, help="disk saves every N steps (1000: only the final one)")
    p.add_argument("--disk", default=tempfile.gettempdir())
    args = p.parse_args()
    tag = uuid.uuid4().hex[:8]
    disk = os.path.join(args.disk, f"lp-bench-tier0-{tag}")
    memory = f"/dev/shm/lp-bench-tier0-{tag}"
    try:
        plain, _ = fit(args, os.path.join(disk, "plain"), None, args.steps)
        tiered, _ = fit(args, os.path.join(disk, "tier0"), memory, args.steps)
        base, with0 = step_s(plain), step_s(tiered)
        # restarts: a fit of one step more, resumed from tier 0 (newest) or from disk only
        from_memory, cb_m = fit(args, os.path.join(disk, "tier0"), memory, args.steps + 1 + args.k)
        from_disk, cb_d = fit(args, os.path.join(disk, "plain"), None, args.steps + 1 + args.k)
        restart_m = from_memory.first_step - from_memory.fit_start
        restart_d = from_disk.first_step - from_disk.fit_start
        print(f"model {args.mb} MB (+ Adam), {args.steps} steps, step sleep {args.step_sleep}s, tier 0 every {args.k}")
        print(f"resumed from: memory run {cb_m.resumed_from}; disk run {cb_d.resumed_from}\n")
        print(table(["", "seconds", "ratio"], [
            ["step time, no tier 0", f"{base:.4f}", "1.00"],
            [f"step time, tier 0 every {args.k}", f"{with0:.4f}", f"{with0 / base:.3f}"],
            ["restart to first step, from disk", f"{restart_d:.3f}", "1.00"],
            ["restart to first step, from /dev/shm", f"{restart_m:.3f}", f"{restart_m / restart_d:.2f}"],
        ]))  # fmt: skip
        print("\n" + machine_notes())
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)


if __name__ == "__main__":
    main()
