"""DeepSpeed ZeRO: the cost of committing its checkpoints (lightning/deepspeed.py) against
DeepSpeed's own save of the same state, on 2 CPU ranks over gloo (tests/support/deepspeed_cpu.py).

Inside one ``Trainer.fit`` (ZeRO-3, AdamW, tests' TinyModel of ``--width``: 10 x width
parameters, 2.5M -> 100 MB of fp32 weights; the optimizer state doubles it), at step 2, the
same Lightning checkpoint dict is saved round by round, the two ways interleaved (round 0 is
the warm-up and is not reported):

* ``deepspeed``: Lightning's own ``DeepSpeedStrategy.save_checkpoint`` (DeepSpeed's
  ``save_checkpoint``: every rank's files, its ``latest``; no fsync), between barriers;
* ``deepspeed+fsync``: the same, then each rank fsyncs its files (durable, as ours);
* ``ours``: the strategy's save with the package's glue (the path the SIGTERM snapshot takes:
  ``engine.save`` -> ``trainer.save_checkpoint`` -> this), ``blocking`` until it returns,
  ``commit`` until the manifest is written (read-back CRC32C, fsync, gather, manifest), between
  barriers.

The ratio is the median of per-round ``ours commit / deepspeed``. Needs DeepSpeed
(``bash scripts/_venv_deepspeed.sh``):

    PYTHONPATH=. .venv-ds/bin/python benchmarks/bench_deepspeed_commit.py [--width 2500000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import lightning as L
import torch
from deepspeed_cpu import CPUDeepSpeedStrategy
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy
from models import TinyModel, data
from torch.utils.data import DataLoader

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO
from lightning_preempt.format.names import checkpoint_name


class Measure(Callback):
    def __init__(self, dirpath: str, scratch: str, rounds: int) -> None:
        self.dirpath, self.scratch, self.rounds = dirpath, scratch, rounds
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != 2:
            return
        strategy = trainer.strategy
        io = strategy.checkpoint_io
        assert isinstance(io, ShardedAsyncCheckpointIO)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for i in range(self.rounds + 1):
            row: dict[str, float] = {}
            # Alternating order: neither always writes behind the other's dirty pages.
            for way in ("deepspeed", "ours") if i % 2 else ("ours", "deepspeed"):
                strategy.barrier()
                started = time.perf_counter()
                if way == "deepspeed":
                    target = os.path.join(self.scratch, f"ds-{i}")
                    DeepSpeedStrategy.save_checkpoint(strategy, checkpoint, target)
                    strategy.barrier()
                    row["deepspeed"] = time.perf_counter() - started
                    _fsync_mine(os.path.join(target, "checkpoint"), trainer.global_rank)
                    strategy.barrier()
                    row["deepspeed_fsync"] = time.perf_counter() - started
                else:
                    strategy.save_checkpoint(checkpoint, os.path.join(self.dirpath, checkpoint_name(1000 + i)))
                    row["blocking"] = time.perf_counter() - started
                    io.wait()
                    strategy.barrier()
                    row["commit"] = time.perf_counter() - started
            if i:
                self.rows.append(row)
        trainer.should_stop = True


def _fsync_mine(directory: str, rank: int) -> None:
    """fsync the files DeepSpeed's ``rank`` wrote (ZeRO-3: its name carries the rank)."""
    for name in os.listdir(directory):
        if f"zero_pp_rank_{rank}_" in name:
            with open(os.path.join(directory, name), "rb") as f:
                os.fsync(f.fileno())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=2_500_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if "LP_BENCH_DS_ROOT" not in os.environ:  # rank 1 (re-launched by Lightning) inherits rank 0's
        os.environ["LP_BENCH_DS_ROOT"] = tempfile.mkdtemp(prefix="bench_ds_", dir=os.environ.get("LP_BENCH_DIR"))
    root = os.environ["LP_BENCH_DS_ROOT"]
    L.seed_everything(0)
    model = TinyModel(width=args.width)
    measure = Measure(os.path.join(root, "ck"), os.path.join(root, "scratch"), args.rounds)
    trainer = L.Trainer(
        max_steps=10, accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=3),
        callbacks=[PreemptionCallback(os.path.join(root, "ck"), keep_last_n=100, heartbeat_timeout_s=60.0), measure],
        plugins=[ShardedAsyncCheckpointIO()], logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data(256), batch_size=16))
    if trainer.global_rank != 0:
        return 0
    params = 10 * args.width + 1  # TinyModel: Linear(8, width), Tanh, Linear(width, 1)
    size = sum(f.stat().st_size for f in Path(root, "scratch", "ds-1").rglob("*") if f.is_file())
    print(f"\nDeepSpeed ZeRO-3, 2 CPU ranks (gloo): {params * 4 / 1e6:.0f} MB of weights, "
          f"{size / 1e6:.0f} MB per save on disk, {len(measure.rows)} rounds, torch {torch.__version__}")  # fmt: skip
    print(f"{'round':>5} {'deepspeed s':>12} {'ds+fsync s':>11} {'ours blocking s':>16} {'ours commit s':>14} "
          f"{'commit/ds':>10} {'commit/(ds+fsync)':>18}")  # fmt: skip
    for i, row in enumerate(measure.rows, 1):
        print(f"{i:>5} {row['deepspeed']:>12.3f} {row['deepspeed_fsync']:>11.3f} {row['blocking']:>16.3f} "
              f"{row['commit']:>14.3f} {row['commit'] / row['deepspeed']:>10.2f} "
              f"{row['commit'] / row['deepspeed_fsync']:>18.2f}")  # fmt: skip

    def median(key: str, over: str) -> float:
        return statistics.median(r[key] / r[over] for r in measure.rows)

    shutil.rmtree(root, ignore_errors=True)  # ~0.5 GB a round
    print(f"median commit/deepspeed {median('commit', 'deepspeed'):.2f}, commit/(deepspeed+fsync) "
          f"{median('commit', 'deepspeed_fsync'):.2f} (target <= 1.10); blocking/deepspeed "
          f"{median('blocking', 'deepspeed'):.2f}; slowest commit {max(r['commit'] for r in measure.rows):.2f} s "
          "(grace 30 s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
