"""Two ranks, one replicated state: saving on every rank (DCP splits it) vs rank 0 alone.

Both ranks (gloo, CPU, torch.multiprocessing) hold the same Lightning-style checkpoint.
Methods, interleaved round by round (round 0 is a warm-up):

* ours, collective: ``ShardedAsyncCheckpointIO.enable_collective_saves(group)`` on both
  ranks, both call ``save_checkpoint`` (what ``PreemptionCallback`` does under DDP);
* ours, rank 0 only: the plugin without a group, called on rank 0 (Lightning's default
  for DDP: ``CheckpointIO`` runs on global rank 0 only);
* torch.save, rank 0 only: plain ``torch.save`` + fsync on rank 0.

Bytes per rank come from the manifest: ``__{R}_*.distcp`` and ``state-rank{R}.pt`` belong
to rank R (``.metadata`` and ``manifest.json`` are written by rank 0).

    python benchmarks/bench_ranks.py             # 384 MiB replicated, ~1-2 min
    python benchmarks/bench_ranks.py --quick     # 64 MiB
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    MiB,
    fmt_range,
    fsync_path,
    lightning_style_checkpoint,
    machine_notes,
    median,
    nbytes,
    table,
    verdict,
)

METHODS = ("ours_collective", "ours_rank0", "torch_rank0")
LABELS = {
    "ours_collective": "ours, every rank saves (collective)",
    "ours_rank0": "ours, rank 0 only",
    "torch_rank0": "torch.save + fsync, rank 0 only",
}


def bytes_per_rank(ckpt_dir: str, world: int) -> list[int]:
    """Bytes each rank wrote, from the manifest's file list."""
    from lightning_preempt.read.verify import read_manifest
    from lightning_preempt.storage.store import Store

    manifest = read_manifest(Store(ckpt_dir))
    out = [0] * world
    for name, entry in manifest.files.items():
        m = re.match(r"__(\d+)_\d+\.distcp$", name) or re.match(r"state-rank(\d+)\.pt$", name)
        out[int(m.group(1)) if m else 0] += entry.size  # .metadata: rank 0 (the coordinator)
    out[0] += os.path.getsize(os.path.join(ckpt_dir, "manifest.json"))
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, root: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from lightning_preempt import ShardedAsyncCheckpointIO
    from lightning_preempt.collective import groups as pdist

    torch.set_num_threads(1)  # two ranks on two cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    writer_group = pdist.new_gloo_group()
    ckpt = lightning_style_checkpoint(args.size_mib * MiB, args.tensors)  # same seed: replicated
    collective = ShardedAsyncCheckpointIO()
    collective.enable_collective_saves(writer_group)
    solo = ShardedAsyncCheckpointIO()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    n = 0
    for rnd in range(args.repeats + 1):
        order = METHODS[rnd % 3 :] + METHODS[: rnd % 3]
        for method in order:
            n += 1
            path = os.path.join(root, f"{method}-{n:03d}")
            dist.barrier()
            t0 = time.perf_counter()
            blocking = commit = None
            if method == "ours_collective":
                collective.save_checkpoint(ckpt, path)
                blocking = time.perf_counter() - t0
                collective.wait()
                commit = time.perf_counter() - t0
            elif rank == 0 and method == "ours_rank0":
                solo.save_checkpoint(ckpt, path)
                blocking = time.perf_counter() - t0
                solo.wait()
                commit = time.perf_counter() - t0
            elif rank == 0 and method == "torch_rank0":
                os.makedirs(path)
                file = os.path.join(path, "last.ckpt")
                torch.save(ckpt, file)
                fsync_path(file)
                fsync_path(path)
                blocking = commit = time.perf_counter() - t0
            dist.barrier()
            wall = time.perf_counter() - t0
            written = [0] * world
            if rank == 0:
                if method == "torch_rank0":
                    written[0] = os.path.getsize(os.path.join(path, "last.ckpt"))
                else:
                    written = bytes_per_rank(path, world if method == "ours_collective" else 1) + (
                        [] if method == "ours_collective" else [0] * (world - 1)
                    )
            if rnd > 0:
                results[method].append({"blocking": blocking, "commit": commit, "wall": wall, "written": written})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    collective.teardown()
    solo.teardown()
    with open(os.path.join(root, f"ranks-rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> str:
    import socket

    import torch.multiprocessing as mp

    root = args.dir or tempfile.mkdtemp(prefix="lp-bench-ranks-", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    try:
        mp.spawn(_worker, args=(2, port, args, root), nprocs=2, join=True)
        per_rank = []
        for r in range(2):
            with open(os.path.join(root, f"ranks-rank{r}.json")) as f:
                per_rank.append(json.load(f))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started
    total = nbytes(lightning_style_checkpoint(MiB, args.tensors)) * args.size_mib  # same shapes, scaled

    rows = []
    for m in METHODS:
        r0, r1 = per_rank[0][m], per_rank[1][m]
        walls = [x["wall"] for x in r0]
        b0 = [x["blocking"] for x in r0 if x["blocking"] is not None]
        b1 = [x["blocking"] for x in r1 if x["blocking"] is not None]
        c0 = [x["commit"] for x in r0 if x["commit"] is not None]
        c1 = [x["commit"] for x in r1 if x["commit"] is not None]
        written = r0[-1]["written"]
        rows.append(
            [
                LABELS[m],
                f"{median(b0):.3f}" + (f" / {median(b1):.3f}" if b1 else " / —"),
                f"{median(c0):.3f}" + (f" / {median(c1):.3f}" if c1 else " / —"),
                f"{median(walls):.3f} ({fmt_range(walls)})",
                " / ".join(f"{w / MiB:.1f}" for w in written),
            ]
        )

    def wall(m: str) -> list[float]:
        return [x["wall"] for x in per_rank[0][m]]

    def ratio(a: str, b: str) -> float:
        return median([x / y for x, y in zip(wall(a), wall(b), strict=True)])

    checks = [
        verdict("ours collective / ours rank 0 only (save time)", ratio("ours_collective", "ours_rank0"), 1.0, False),
        verdict("ours collective / torch.save rank 0 only (save time)", ratio("ours_collective", "torch_rank0"), 1.0, False),
    ]
    w0, w1 = per_rank[0]["ours_collective"][-1]["written"]
    share = max(w0, w1) / max(1, w0 + w1)
    checks.append(verdict("collective: largest rank's share of the bytes", share, 0.6, False))
    out = [
        f"### bench_ranks: 2 gloo ranks, {args.size_mib} MiB replicated state in {args.tensors} tensors, "
        f"{args.repeats} measured rounds after 1 warm-up (run took {elapsed:.0f}s)",
        "",
        f"Machine: {machine_notes()}; state per rank {total / MiB:.0f} MiB",
        "",
        table(
            [
                "method",
                "blocks (s) rank 0 / 1",
                "committed (s) rank 0 / 1",
                "save wall time, all ranks (s)",
                "MiB written rank 0 / 1",
            ],
            rows,
        ),
        "",
        "Ratios (median of per-round ratios of the all-ranks wall time; targets are ours: the collective save "
        "should be faster than rank-0-only and split the bytes):",
        "",
        table(["ratio", "value", "target", "verdict"], [c[0] for c in checks]),
        "",
        *[c[1] for c in checks],
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=384, help="replicated state size in MiB (default 384)")
    p.add_argument("--tensors", type=int, default=16, help="number of tensors (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds after the warm-up (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 64 MiB")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib = 64
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
