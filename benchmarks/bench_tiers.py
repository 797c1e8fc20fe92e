"""Storage tiers: the remote tiers behind a local one, tier 0 across two nodes, the host budget.

(a) Two-tier mode per remote tier: a second local directory (the baseline), the GCS emulator
    and moto's S3 server on 127.0.0.1 (tests/support/servers.py), ``local_dirpath`` on local
    disk: save (blocking), local commit, drain to the remote, a direct commit to the remote
    (no local tier), resume from each tier (CRC32C verified). Medians; (Nx) = ratio to local disk.
(b) Tier 0 (docs/tier0.md) on two gloo ranks playing two nodes, each its own root under
    /dev/shm: a tier-0 copy through the real saver (each rank writes half), the peer copy to
    the other node (``MemoryTier.after_copy``), and the restore of a wiped (replacement) node.
(c) ``host_memory_budget``: peak RSS growth, the stager's peak and blocking time of saves with
    no budget, a budget equal to the state and half of it (one fresh process a row).

    python benchmarks/bench_tiers.py             # (a)-(c), 256 MiB
    python benchmarks/bench_tiers.py --quick     # 32 MiB, 1 round
    python benchmarks/bench_tiers.py --parts c --size-mib 1024   # the host budget at 1 GiB
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
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import ROOT, MiB, fmt_range, fmt_s, header, lightning_style_checkpoint, median, spawn_gloo, table

COLUMNS = ("save (blocking)", "local commit", "drain", "direct commit", "resume local", "resume remote")


# ---------------------------------------------------------------- (a) remote tiers
def one_round(
    remote_root: str, options: dict[str, Any], scratch: str, ckpt: dict[str, Any], r: int
) -> dict[str, float]:
    from lightning_preempt import ShardedAsyncCheckpointIO

    name = f"step-{r:010d}"
    local = os.path.join(scratch, f"local-{r}")
    io = ShardedAsyncCheckpointIO(storage_options=options)
    io.saver.use_local_tier(local)  # what the callback's local_dirpath does (lightning/strategies.hand_options)
    assert io.tiers is not None
    io.set_tiers(remote_root)
    out: dict[str, float] = {}
    try:
        started = time.perf_counter()
        io.save_checkpoint(ckpt, f"{remote_root}/{name}")
        out["save (blocking)"] = time.perf_counter() - started
        io.wait()
        record = io.history[-1]
        out["local commit"] = record.committed_s or float("nan")
        io.wait_drained()
        drain = io.tiers.drains[-1]
        if drain.error:
            raise RuntimeError(drain.error)
        out["drain"] = drain.drained_s or float("nan")

        started = time.perf_counter()
        io.load_checkpoint(os.path.join(local, name))
        out["resume local"] = time.perf_counter() - started
    finally:
        io.teardown()

    fresh = ShardedAsyncCheckpointIO(storage_options=options)  # a new node: empty local tier
    try:
        started = time.perf_counter()
        fresh.load_checkpoint(f"{remote_root}/{name}")
        out["resume remote"] = time.perf_counter() - started
        started = time.perf_counter()
        fresh.save_checkpoint(ckpt, f"{remote_root}/direct-{r}")
        fresh.wait()
        out["direct commit"] = time.perf_counter() - started
    finally:
        fresh.teardown()
    shutil.rmtree(local, ignore_errors=True)
    return out


def remote_tiers(args: argparse.Namespace) -> str:
    import servers  # tests/support; sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT before gcsfs is imported

    from lightning_preempt.storage.store import Store

    ckpt = lightning_style_checkpoint(args.size_mib * MiB, n_tensors=16)
    scratch = tempfile.mkdtemp(prefix="lp-bench-tiers-")
    gcs, s3 = servers.start_gcs(), servers.start_s3()
    servers.point_gcsfs_at(gcs)
    targets = [("local disk", os.path.join(scratch, "remote"), {}), ("GCS emulator", gcs.url("bench"),
               dict(gcs.storage_options)), ("moto S3", s3.url("bench"), dict(s3.storage_options))]  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    try:
        for label, root, options in targets:
            Store(root, options).stat()  # import and connect the client outside the timings
            rounds = [one_round(root, options, scratch, ckpt, r) for r in range(args.rounds)]
            results[label] = {c: median([x[c] for x in rounds]) for c in COLUMNS}
    finally:
        gcs.stop()
        s3.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    base, rows = results["local disk"], []
    for label, res in results.items():
        rows.append([label, *(fmt_s(res[c]) if label == "local disk" else f"{fmt_s(res[c])} ({res[c] / base[c]:.1f}x)"
                              for c in COLUMNS)])  # fmt: skip
    return "\n".join([f"(a) Two-tier checkpoints, {args.size_mib} MiB, median of {args.rounds} round(s); seconds, "
                      "(Nx) = ratio to local disk", "", table(["remote tier", *COLUMNS], rows), ""])  # fmt: skip


# ---------------------------------------------------------------- (b) tier 0 across two nodes
def _tier0_worker(rank: int, world: int, size_mib: int, rounds: int, work: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.engine.memory_tier import MemoryTier
    from lightning_preempt.save.order import SaveOrder
    from lightning_preempt.save.saver import Saver

    root = os.path.join(work, f"node{rank}")
    saver = Saver({})
    saver.enable_collective(new_gloo_group())
    peer_group = new_gloo_group()
    tier = MemoryTier(root, every=1)
    assert tier.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: peer_group)
    g = torch.Generator().manual_seed(0)  # the same replicated state on both ranks
    state: dict[str, Any] = {"state_dict": {"w": torch.randn(size_mib * MiB // 4, generator=g)}}
    times = []
    for step in range(1, rounds + 2):
        state["global_step"] = step
        path = tier.path(step, dist.group.WORLD)
        assert path is not None
        t0 = time.perf_counter()
        saver.save(state, SaveOrder(path, "tier0"))
        saver.wait()
        t1 = time.perf_counter()
        tier.after_copy(saver, path, "bench", leader=rank == 0)
        saver.wait()
        times.append((t1 - t0, time.perf_counter() - t1))
    dist.barrier()
    if rank == 1:
        shutil.rmtree(root)  # a replacement node: its tier-0 root is empty
    dist.barrier()
    t0 = time.perf_counter()
    again = MemoryTier(root, every=1)
    assert again.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: peer_group, restore_floor=lambda: -1)
    restore_s = time.perf_counter() - t0
    saver.close()
    with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
        json.dump({"rounds": times[1:], "restore_s": restore_s, "restored": again.restored_step}, f)


def tier0(args: argparse.Namespace) -> str:
    work = tempfile.mkdtemp(prefix="lp-bench-tier0-", dir="/dev/shm")
    try:
        spawn_gloo(_tier0_worker, 2, args.size_mib, args.rounds, work)
        out = [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    pairs = list(zip(out[0]["rounds"], out[1]["rounds"], strict=True))  # a round ends when both ranks are done
    write, peer = [max(a[0], b[0]) for a, b in pairs], [max(a[1], b[1]) for a, b in pairs]
    ok = out[1]["restored"] == args.rounds + 1
    return "\n".join([
        f"(b) Tier 0 across two nodes: {args.size_mib} MiB replicated state, 2 ranks / 2 nodes, median of "
        f"{args.rounds} rounds (slower rank); the restore fills a wiped node from its peer", "",
        table(["tier-0 write (s)", "peer copy (s)", "peer / write", "restore to an empty node (s)", "restored step"],
              [[f"{median(write):.3f} ({fmt_range(write)})", f"{median(peer):.3f} ({fmt_range(peer)})",
                f"{median(peer) / median(write):.2f}", f"{max(o['restore_s'] for o in out):.3f}",
                f"{out[1]['restored']} ({'the newest: ok' if ok else 'NOT the newest'})"]]), "",
    ])  # fmt: skip


# ---------------------------------------------------------------- (c) host budget
def measure(state_mib: int, budget_mib: int, tensors: int, repeats: int) -> dict[str, Any]:
    """One fresh process saving ``state_mib`` under ``budget_mib`` (0: the default budget)."""
    with tempfile.TemporaryDirectory(prefix="lp-bench-budget-") as out:
        cmd = [sys.executable, str(ROOT / "tests" / "support" / "budget_rss.py"), out, "--state-mib", str(state_mib),
               "--budget-mib", str(budget_mib), "--tensors", str(tensors), "--repeats", str(repeats)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"budget_rss.py failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def host_budget(args: argparse.Namespace) -> str:
    """(c): one row per budget (a fresh process each: tests/support/budget_rss.py), then the checks of issue 25."""
    state, tensors, device = args.size_mib, 16, "cpu"
    rows: list[list[str]] = []
    got: dict[int, dict[str, Any]] = {}
    for label, budget in (("none given (default)", 0), ("= the state", state), ("= half the state", state // 2)):
        r = measure(state, budget, tensors, args.rounds)
        got[budget] = r
        blocks = [float(b) for b in r["blocking_s"]]
        rows.append([
            label, f"{(r['budget'] or 0) / MiB:.0f}" if r["budget"] else "—", f"{int(r['peak_growth']) / MiB:.1f}",
            f"{int(r['stager_peak']) / MiB:.1f}", f"{int(r['streamed']) / MiB:.0f}",
            f"{median(blocks):.3f}", fmt_range(blocks), "yes" if r["exact"] else "NO",
        ])  # fmt: skip
    half, full = got[state // 2], got[0]
    under = int(half["stager_peak"]) <= int(half["budget"])
    over_rss = (int(half["peak_growth"]) - int(half["budget"])) / MiB
    ratio = median(half["blocking_s"]) / median(full["blocking_s"])
    same = median(got[state]["blocking_s"]) / median(full["blocking_s"])
    return "\n".join([
        f"(c) Host-memory budget: {state} MiB in {tensors} float32 tensors on {device}, {args.rounds} saves per row "
        "(one fresh process per row)",
        "",
        table(["host_memory_budget", "MiB", "peak RSS growth (MiB)", "stager peak (MiB)", "streamed (MiB)",
               "blocks (s)", "range", "resumes exactly"], rows),
        "",
        f"- budget = half the state: peak staging memory (the stager's) {int(half['stager_peak']) / MiB:.1f} MiB "
        f"{'<=' if under else '>'} budget {int(half['budget']) / MiB:.0f} MiB: {'met' if under else 'MISSED'}; "
        f"the process's peak RSS growth is {over_rss:+.1f} MiB from the budget (the save's non-staging memory: "
        "the writer's 1 MiB buffer, the pickled skeleton, Python objects)",
        f"- budget = half the state: blocking {ratio:.2f}x the unbudgeted save's (the streamed half is written "
        "before the save returns)",
        f"- budget = the state: nothing streamed (the path of no budget); blocking {same:.2f}x the unbudgeted "
        f"save's (ranges {fmt_range(got[state]['blocking_s'])} s vs {fmt_range(full['blocking_s'])} s)",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256, help="state size (default 256)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (a), (b); saves a row (c) (default 3)")
    p.add_argument("--parts", default="abc", help="a (remote tiers), b (tier 0), c (host budget); default abc")
    p.add_argument("--quick", action="store_true", help="smoke run: 32 MiB, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.rounds = 32, 1
    started = time.perf_counter()
    parts = {"a": remote_tiers, "b": tier0, "c": host_budget}
    out = [parts[k](args) for k in args.parts]
    print("\n".join(header("bench_tiers", f"run took {time.perf_counter() - started:.0f}s") + out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
