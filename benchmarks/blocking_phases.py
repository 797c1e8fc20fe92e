"""Where a save's blocking time goes inside a real ``Trainer.fit`` (issue 33), phase by phase.

bench_fit_overhead.py's fit (the same model, 24 or 4000 tensors, 50 ms steps) with ours
(``PreemptionCallback`` + ``ShardedAsyncCheckpointIO``) saving every step (``--every``). Each phase of
``Saver.save`` on the training thread is timed by wrapping the function where the saver looks
it up: the split, this rank's share, the skeleton's pickle, the layout check, the budget's
split, the staging copy; beside them the whole save without its wait for the previous one
(``Saver.history``), Lightning's ``dump_checkpoint`` (outside our save, in every method's
cost) and the copy floor (one ``_foreach_copy_`` of the whole state into touched buffers,
caches flushed: bench_fit_overhead.copy_floor), of a new model's tensors and of the fit's own
(where they lie in memory; under DDP a rank's whole state, of which it stages its share).
Medians over the saves after the first ``--skip``. Rank 0's figures; ``--ranks N`` runs the
fit under torchrun.

    python benchmarks/blocking_phases.py                   # 1 rank, 4000 tensors, 40 saves
    python benchmarks/blocking_phases.py --ranks 2 --runs 5
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, machine_notes, median, table

PHASES = ("split", "share", "skeleton", "layout check", "budget split", "staging copy")


#: the run being timed (the wrappers are installed once per process)
CURRENT: list[dict[str, list[float]]] = [collections.defaultdict(list)]


def instrument() -> None:
    from lightning.pytorch.trainer.connectors import checkpoint_connector

    from lightning_preempt.format import skeleton
    from lightning_preempt.save import saver
    from lightning_preempt.staging import budget, overlap, stager

    def wrap(owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                CURRENT[0][name].append(time.perf_counter() - t0)

        setattr(owner, attr, timed)

    wrap(skeleton.Splitter, "split", "split")
    wrap(saver.Saver, "_my_share", "share")
    wrap(saver, "skeleton_bytes", "skeleton")
    wrap(stager.HostStager, "unchanged", "layout check")
    wrap(budget.StagingBudget, "split", "budget split")
    wrap(overlap.Overlap, "stage", "staging copy")
    wrap(checkpoint_connector._CheckpointConnector, "dump_checkpoint", "Lightning's dump_checkpoint")


def worker(args: argparse.Namespace) -> int:
    import lightning as L
    import torch
    from bench_fit_overhead import Batches, build, copy_floor, own_tensors
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_preempt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)  # as torchrun sets it
    world = int(os.environ.get("WORLD_SIZE", "1"))
    runs: list[dict[str, Any]] = []
    instrument()
    for _ in range(args.runs):
        times: dict[str, list[float]] = collections.defaultdict(list)
        CURRENT[0] = times
        io = ShardedAsyncCheckpointIO()
        trainer = L.Trainer(
            max_steps=(args.saves + args.skip) * args.every, accelerator="cpu", devices=world,
            strategy=DDPStrategy(broadcast_buffers=False) if world > 1 else "auto",
            callbacks=[PreemptionCallback(os.path.join(args.root, f"run{len(runs)}"), every_n_train_steps=args.every, keep_last_n=2)],
            plugins=[io], enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(build(args.width, args.tensors, args.step_ms), Batches(args.width, 16, "cpu"))
        history = io.saver.history[args.skip :]
        run = {name: median(values[args.skip :]) * 1e3 for name, values in times.items() if values[args.skip :]}
        run["save (without its wait)"] = median([r.blocking_s - r.waited_s for r in history]) * 1e3
        run["copy floor"] = copy_floor(args.width, args.tensors, "cpu") * 1e3
        run["copy floor, the fit's own tensors"] = copy_floor(args.width, args.tensors, "cpu",
                                                              sources=own_tensors(trainer)) * 1e3  # fmt: skip
        runs.append(run)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(runs, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--tensors", type=int, default=4000)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--every", type=int, default=1, help="save every N steps (default 1)")
    p.add_argument("--saves", type=int, default=40, help="timed saves a run (default 40)")
    p.add_argument("--skip", type=int, default=5, help="saves not timed at the start of a run (default 5)")
    p.add_argument("--runs", type=int, default=1, help="fits, each with its own figures (default 1)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lp-blocking-") as root:
        out = os.path.join(root, "out.json")
        rest = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "out", "root")]
        launcher = [sys.executable]
        if args.ranks > 1:
            launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}", f"--master-port={free_port()}"]
        script = [os.path.abspath(__file__), "--worker", f"--out={out}", f"--root={root}", *rest]
        subprocess.run([*launcher, *script], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            runs = json.load(f)
    names = [*PHASES, "save (without its wait)", "copy floor", "copy floor, the fit's own tensors",
             "Lightning's dump_checkpoint"]  # fmt: skip
    header = ["ms (median over a run's saves), rank 0", *(f"run {i + 1}" for i in range(len(runs)))]
    rows = [[name, *(f"{run[name]:.2f}" if name in run else "—" for run in runs)] for name in names]
    ratios = [run["save (without its wait)"] / run["copy floor"] for run in runs]
    own = [run["save (without its wait)"] / run["copy floor, the fit's own tensors"] for run in runs]
    rows.append(["save / copy floor", *(f"{r:.2f}" for r in ratios)])
    rows.append(["save / copy floor of the fit's own tensors", *(f"{r:.2f}" for r in own)])
    print(f"### Blocking by phase: {args.ranks} rank(s), {args.tensors} tensors, a save every {args.every} step(s), "
          f"{args.saves} timed saves a run\n")  # fmt: skip
    print(machine_notes() + f"; run took {time.perf_counter() - started:.0f}s\n")
    print(table(header, rows))
    print(f"\n- save <= 1.2x the copy floor in {sum(r <= 1.2 for r in ratios)} of {len(ratios)} runs; "
          f"<= 1.2x that of the fit's own tensors in {sum(r <= 1.2 for r in own)} of {len(own)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
