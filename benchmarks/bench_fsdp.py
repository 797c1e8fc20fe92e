"""FSDP1 (Lightning's ``FSDPStrategy``, sharded) at 2 ranks: our save and resume against
Lightning's own sharded FSDP save and load of the same state, in one run (issue 54).

Inside one ``Trainer.fit`` (2 ranks on CPU over gloo, tests/support/cpu_fsdp.py's strategy; on a
CUDA host use ``--cuda`` for the real ``FSDPStrategy``), after a few steps of AdamW, each round:

(a) ours: ``trainer.save_checkpoint`` through the plugin; the time training blocks (Lightning's
    dict + staging into reused host buffers) and the time until the commit;
(b) Lightning: the same dict (Lightning's ``dump_checkpoint``) saved by ``FSDPStrategy``'s own
    sharded save (DCP ``save``, synchronous: all of it blocks training);
(c) the floor: one copy of this rank's shard (model + optimizer) into preallocated buffers;
(d) resume: our load (resolve, CRC-check, read in place, resharded) against Lightning's
    sharded ``load_checkpoint`` of its own save, both into the live model and optimizer;
(e) host memory: a rank's peak RSS during its first save above its RSS before it, plus its
    staging buffers (allocated at train start, so already in that RSS), against its shard +
    staging buffers; the whole model for scale.

Lightning's dict (``dump_checkpoint``, where FSDP1 makes its sharded state dict) is timed alone
too: both saves start with it, so it is the floor of any save through ``trainer.save_checkpoint``.

Rounds are interleaved; ratios are medians of per-round ratios (the slower rank counts).

    python benchmarks/bench_fsdp.py                  # 256 MiB of parameters, 3 rounds
    python benchmarks/bench_fsdp.py --size-mib 64 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from _common import fmt_s, machine_notes, median, ratio_table, table
from _models import Noise

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO
from lightning_preempt.collective import groups as pdist

WIDTH = 1024


class Model(L.LightningModule):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(n_layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out: torch.Tensor = self.net(batch).pow(2).mean()
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The peak RSS seen by a thread sampling every 0.5 ms while the block runs."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _local_tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [t for v in state.values() for t in _local_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _local_tensors(v)]
    if isinstance(state, torch.Tensor):
        return [state.to_local() if hasattr(state, "to_local") else state]
    return []


class Measure(Callback):
    """The rounds, at the end of training (every rank; rank 0 prints)."""

    def __init__(self, root: str, rounds: int) -> None:
        self.root, self.rounds = root, rounds

    def _slowest(self, seconds: float) -> float:
        return max(pdist.all_gather_objects(seconds, None))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, FSDPStrategy)
        io = strategy.checkpoint_io
        assert isinstance(io, ShardedAsyncCheckpointIO)
        io.wait()
        base = strategy.broadcast(self.root)
        rss_before = _rss()  # before any save: the model, the optimizer and the staging buffers
        rows: dict[str, list[float]] = {
            k: [] for k in ("ours", "commit", "dict", "lightning", "floor", "ours_load", "l_load")
        }
        peaks: list[int] = []
        shard: list[torch.Tensor] = []
        floor_bufs: list[torch.Tensor] = []
        for rnd in range(self.rounds + 1):
            ours, theirs = f"{base}/ours-{rnd}", f"{base}/lightning-{rnd}"
            strategy.barrier()
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                trainer.save_checkpoint(ours, weights_only=False)
                blocked = time.perf_counter() - t0
                io.wait()
                committed = time.perf_counter() - t0
            if rnd == 0:
                # The staging buffers were allocated at train start (prepare_staging), so they
                # are in rss_before: counted as part of the save's memory, the rest measured.
                grown = peak.peak - rss_before + io.staging_allocated_bytes
                peaks.append(max(pdist.all_gather_objects(grown, None)))
                # the floor's state and buffers, made after the memory figure
                shard = _local_tensors(trainer._checkpoint_connector.dump_checkpoint(weights_only=False))
                floor_bufs = [torch.empty_like(t) for t in shard]
            strategy.barrier()
            t0 = time.perf_counter()
            ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            dict_s = time.perf_counter() - t0
            FSDPStrategy.save_checkpoint(strategy, ckpt, theirs)  # Lightning's own sharded save
            lightning = time.perf_counter() - t0
            del ckpt
            strategy.barrier()
            t0 = time.perf_counter()
            for buf, t in zip(floor_bufs, shard, strict=True):
                buf.copy_(t)
            floor = time.perf_counter() - t0
            strategy.barrier()
            t0 = time.perf_counter()
            strategy.load_checkpoint(ours)
            ours_load = time.perf_counter() - t0
            strategy.barrier()
            t0 = time.perf_counter()
            FSDPStrategy.load_checkpoint(strategy, theirs, weights_only=False)  # its own file (numpy RNG states)
            l_load = time.perf_counter() - t0
            if rnd:  # round 0 warms every path up
                values = (blocked, committed, dict_s, lightning, floor, ours_load, l_load)
                for key, value in zip(rows, values, strict=True):
                    rows[key].append(self._slowest(value))
        shard_bytes = sum(t.numel() * t.element_size() for t in shard)
        staging = max(pdist.all_gather_objects(io.staging_allocated_bytes, None))
        shard_bytes = max(pdist.all_gather_objects(shard_bytes, None))
        model_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters()) * strategy.world_size
        if trainer.is_global_zero:
            self._report(rows, peaks, staging, shard_bytes, model_bytes)

    def _report(self, rows: dict[str, list[float]], peaks: list[int], staging: int, shard: int, model: int) -> None:
        mib = 1 << 20
        print(f"\nFSDP1, 2 ranks; {machine_notes()}")
        print(f"each rank's shard (model + AdamW state): {shard / mib:.0f} MiB; its staging buffers "
              f"{staging / mib:.0f} MiB; whole model (parameters) {model / mib:.0f} MiB\n")  # fmt: skip
        names = {"ours": "ours: training blocked", "commit": "ours: committed after",
                 "dict": "Lightning's dict alone (dump_checkpoint; in both saves)", "lightning":
                 "Lightning's sharded save (all blocking)", "floor": "floor: one copy of the shard",
                 "ours_load": "ours: resume (load)", "l_load": "Lightning's sharded load"}  # fmt: skip
        print(table(["seconds (slowest rank)", "median", "rounds"],
                    [[names[k], fmt_s(median(v)), " ".join(fmt_s(x) for x in v)] for k, v in rows.items()]))
        print(f"\npeak RSS during our first save above the RSS before it, plus the staging buffers (allocated "
              f"at train start): {peaks[0] / mib:.0f} MiB (limit: shard + staging = {(shard + staging) / mib:.0f} MiB; "
              f"a save that gathered the model would hold {model / mib:.0f} MiB more)\n")  # fmt: skip
        ratios = [
            ("ours blocked / Lightning's save", median([a / b for a, b in zip(rows["ours"], rows["lightning"])]), 0.25, False),
            ("ours resume / Lightning's load", median([a / b for a, b in zip(rows["ours_load"], rows["l_load"])]), 1.2, False),
            ("peak RSS / (shard + staging)", max(peaks) / (shard + staging), 1.0, False),
        ]  # fmt: skip
        print("\n".join(ratio_table(ratios)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="parameters of the whole model (float32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cuda", action="store_true", help="Lightning's FSDPStrategy on 2 GPUs (NCCL)")
    args = p.parse_args()
    n_layers = max(2, args.size_mib * (1 << 20) // (4 * WIDTH * (WIDTH + 1)))
    if args.cuda:
        strategy: Any = FSDPStrategy(auto_wrap_policy={torch.nn.Linear}, state_dict_type="sharded")
    else:
        from cpu_fsdp import CPUFSDPStrategy

        strategy = CPUFSDPStrategy(auto_wrap_policy={torch.nn.Linear}, state_dict_type="sharded")
    # One root on every rank: made by the launching process, inherited by the ranks it starts
    # (every rank building its own would be refused: the ranks must agree on dirpath).
    if "LP_BENCH_FSDP_ROOT" not in os.environ:
        os.environ["LP_BENCH_FSDP_ROOT"] = tempfile.mkdtemp(prefix="lp-bench-fsdp-", dir=os.environ.get("LP_BENCH_DIR"))
    root = os.environ["LP_BENCH_FSDP_ROOT"]
    trainer = L.Trainer(
        max_steps=3, accelerator="cuda" if args.cuda else "cpu", devices=2, strategy=strategy,
        callbacks=[Measure(root, args.rounds), PreemptionCallback(f"{root}/run", keep_last_n=1, save_on_train_end=False)],
        plugins=[ShardedAsyncCheckpointIO()], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=True,
    )  # fmt: skip
    trainer.fit(Model(n_layers), DataLoader(Noise(WIDTH), batch_size=8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
