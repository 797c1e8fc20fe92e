"""A save's cost on 1, 2 and 4 ranks, every rank holding the same replicated state (issue 33).

Every rank saves its share collectively (what ``PreemptionCallback`` does under DDP; the
workers are bench_save.py's: gloo, one process per rank, the state replicated, a fresh
path per round, ``wait()`` after each save). Per world size: how long the slowest rank's
``save_checkpoint`` blocks and how long until it is committed, and both against the same
figures on 1 rank (a group of one, the same code path without peers). The target: a 2- and
4-rank save blocks no longer than 1.2x the 1-rank one. A 4-rank world on a 2-core machine
runs two ranks per core: its figures include that.

    python benchmarks/bench_rank_scaling.py                      # 64 MiB as 4000 tensors, 1,2,4 ranks
    python benchmarks/bench_rank_scaling.py --tensors 24 --size-mib 256
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_range, machine_notes, median, table
from bench_save import _rank_worker


def run_world(args: argparse.Namespace, world: int) -> dict[str, list[float]]:
    """bench_save.py's rank worker on ``world`` ranks: per round, the slowest rank's times."""
    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix=f"lp-bench-rank-scaling{world}-", dir=args.dir or "/tmp")
    try:
        mp.start_processes(
            _rank_worker,
            args=(os.path.join(root, "init"), root, args.size_mib, args.tensors, args.repeats, world),
            nprocs=world,
            start_method="spawn",
        )
        with open(os.path.join(root, "ranks.json")) as f:
            return dict(json.load(f))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def exchange(args: argparse.Namespace, repeats: int = 7) -> list[list[str]]:
    """What DCP sends between ranks after the write of a save with an unchanged plan, as DCP
    sent it (every rank's ``WriteResult`` list gathered, the whole ``Metadata`` broadcast)
    and as it travels now (write/dcp_exchange.py): bytes, and pickling + unpickling time
    (the part of the exchange that is CPU; the transport is on top). From a real save's
    plan cache, one process."""
    import pickle

    from _common import lightning_style_checkpoint

    from lightning_preempt import ShardedAsyncCheckpointIO
    from lightning_preempt.write.dcp_exchange import KeptMetadata, SentResults

    root = tempfile.mkdtemp(prefix="lp-bench-exchange-", dir=args.dir or "/tmp")
    try:
        io = ShardedAsyncCheckpointIO()
        ckpt = lightning_style_checkpoint(args.size_mib << 20, args.tensors)
        for i in range(2):  # the second save replays the plan and the layout
            io.save_checkpoint(ckpt, os.path.join(root, f"s{i}"))
            io.wait()
        cache = io.saver.plan_cache
        assert cache.records is not None and cache.metadata is not None
        results, metadata = cache.records.flat, cache.metadata
        io.teardown()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def cost(obj: object) -> tuple[int, float]:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pickle.loads(pickle.dumps(obj))
            times.append(time.perf_counter() - t0)
        return len(pickle.dumps(obj)), median(times)

    rows = []
    for what, before, now in (
        ("one rank's write results (gathered)", list(results), SentResults(results, "0" * 32, same=True)),
        ("the coordinator's Metadata (broadcast)", metadata, KeptMetadata(metadata)),
    ):
        (b_bytes, b_s), (n_bytes, n_s) = cost(before), cost(now)
        rows.append([what, f"{b_bytes / 1024:.1f}", f"{1e3 * b_s:.2f}", f"{n_bytes / 1024:.2f}", f"{1e3 * n_s:.3f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=64, help="replicated state size in MiB (default 64)")
    p.add_argument("--tensors", type=int, default=4000, help="number of tensors (default 4000)")
    p.add_argument("--ranks", default="1,2,4", help="world sizes, comma list (default 1,2,4; 1 is the reference)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds after a warm-up (default 5)")
    args = p.parse_args(argv)
    worlds = sorted({int(w) for w in args.ranks.split(",") if w.strip()} | {1})
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started = time.perf_counter()
    times = {world: run_world(args, world) for world in worlds}
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    one_block, one_commit = median(times[1]["blocking"]), median(times[1]["committed"])
    rows, verdicts = [], []
    for world, t in times.items():
        block, commit = median(t["blocking"]), median(t["committed"])
        rows.append([str(world), f"{block:.3f}", fmt_range(t["blocking"]), f"{block / one_block:.2f}",
                     f"{commit:.3f}", fmt_range(t["committed"]), f"{commit / one_commit:.2f}",
                     f"{median(t['floor_copy']):.3f}"])  # fmt: skip
        if world > 1:
            ratio = block / one_block
            verdicts.append(f"- {world} ranks: blocks {ratio:.2f}x the 1-rank save (target <= 1.2: "
                            f"{'met' if ratio <= 1.2 else 'MISSED'}); committed {commit / one_commit:.2f}x")  # fmt: skip
    print("\n".join([
        f"### A save on 1, 2, 4 ranks: {args.size_mib} MiB replicated as {args.tensors} tensors, "
        f"slowest rank, median of {args.repeats} rounds",
        "",
        f"Machine: {machine_notes()}; run took {time.perf_counter() - started:.0f}s",
        f"`uptime` before: {load}; after: {after}",
        "",
        table(["ranks", "blocks (s)", "range", "/ 1 rank", "committed (s)", "range", "/ 1 rank",
               "copy of its share (s)"], rows),
        "",
        *verdicts,
        "",
        f"What DCP sends between ranks after each save of an unchanged plan ({args.tensors} tensors), "
        "before issue 33 and now (pickled and unpickled once; median of 7):",
        "",
        table(["message", "before: KiB", "before: ms", "now: KiB", "now: ms"], exchange(args)),
    ]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
