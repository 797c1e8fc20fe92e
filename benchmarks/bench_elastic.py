"""Elastic resize times: a node leaves (N -> N-1) and comes back (N-1 -> N) under torchrun.

Simulates 2 nodes as torchrun agents on this machine (``tests/support/elastic_cluster.py``: c10d
rendezvous on a store at 127.0.0.1, one gloo rank per agent, shared dirpath, the fast
rendezvous settings of docs/elastic.md) and prints one markdown table per run:

    python benchmarks/bench_elastic.py [--rounds 1]

Times are wall-clock seconds from the event (the SIGTERM to the leaving node's agent; the
start of the joining node's agent) to the moments the workers report.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from elastic_cluster import Cluster


def leave(tmp: Path) -> dict[str, float | int | str]:
    c = Cluster(tmp, nnodes="1:2", script_args=("--max-steps", "60"))
    try:
        c.start_store()
        c.start("A")
        c.start("B")
        c.wait_step("B", 5)
        t0 = time.time()
        c.preempt("B")
        rc_b = c.wait("B")
        rc_a = c.wait("A")
        (b_exit,) = c.records("B", "exit")
        after = c.records("A", "start")[-1]
        return {
            "event": "node leaves (2 -> 1)",
            "snapshot step": b_exit["step"],
            "resumed step": after["start_step"],
            "steps lost": b_exit["step"] - after["start_step"],
            "world after": after["world_size"],
            "leaving worker exited (s)": b_exit["time"] - t0,
            "training again (s)": after["time"] - t0,
            "exit codes": f"leaving agent {rc_b}, survivor {rc_a} (end)",
        }
    finally:
        c.close()


def join(tmp: Path) -> dict[str, float | int | str]:
    c = Cluster(tmp, nnodes="1:2", script_args=("--max-steps", "100000"))
    try:
        c.start_store()
        c.start("A")
        c.wait_step("A", 5)
        t0 = time.time()
        c.start("B")
        a_starts = c.wait_starts("A", 2)
        (b_start,) = c.wait_starts("B", 1)
        (a_exit,) = c.records("A", "exit")
        for name in ("A", "B"):
            c.preempt(name)
        codes = [c.wait(n) for n in ("A", "B")]
        return {
            "event": "node joins (1 -> 2)",
            "snapshot step": a_exit["step"],
            "resumed step": b_start["start_step"],
            "steps lost": a_exit["step"] - min(b_start["start_step"], a_starts[1]["start_step"]),
            "world after": b_start["world_size"],
            "leaving worker exited (s)": a_exit["time"] - t0,
            "training again (s)": max(b_start["time"], a_starts[1]["time"]) - t0,
            "exit codes": f"running worker {a_exit['code']} (join), agents {codes[0]}/{codes[1]} (end: SIGTERM)",
        }
    finally:
        c.close()


def two_tier_leave(tmp: Path, *, replica: bool, width: int, rate: float) -> dict[str, float | int | str]:
    """Node-local tiers per node, the remote behind a bandwidth limit (``slow://``) that drops
    to ``rate`` at the signal, the leaving node's disk wiped: the snapshot survives only
    through the peer replica."""
    import re
    import shutil

    from throttled_fs import set_rate

    from lightning_preempt.format.names import writer_of

    slow = tmp / "slow"
    args = ("--max-steps", "25", "--every", "10", "--grace", "6", "--width", str(width))
    c = Cluster(tmp, nnodes="1:2", url_prefix="slow://", script_args=(*args, *(("--replica",) if replica else ())))
    env = {"LP_SLOW_DIR": str(slow)}
    try:
        c.start_store()
        c.start("A", env=env, extra=("--local-dirpath", str(tmp / "local-A")))
        c.start("B", env=env, extra=("--local-dirpath", str(tmp / "local-B")))
        c.wait_step("B", 12)
        set_rate(slow, rate)  # the remote's link drops: a rank's share no longer fits the grace
        t0 = time.time()
        c.preempt("B")
        rc_b = c.wait("B")
        snapshot_dir = tmp / "local-B" / f"step-{c.records('B', 'exit')[0]['step']:010d}"
        share = sum(p.stat().st_size for p in snapshot_dir.iterdir() if writer_of(p.name) == 1)
        shutil.rmtree(tmp / "local-B")
        set_rate(slow, 0)
        rc_a = c.wait("A")
        (b_exit,) = c.records("B", "exit")
        after = c.records("A", "start")[-1]
        sent = re.findall(r"replicated step \d+ to a peer node: sent (\d+) B.*in ([0-9.]+)s", c.log("B"))
        row: dict[str, float | int | str] = {
            "event": f"node leaves, two tiers, {'peer replica' if replica else 'no replica'}",
            "snapshot step": b_exit["step"],
            "resumed step": after["start_step"],
            "steps lost": b_exit["step"] - after["start_step"],
            "world after": after["world_size"],
            "leaving worker exited (s)": b_exit["time"] - t0,
            "training again (s)": after["time"] - t0,
            "exit codes": f"leaving agent {rc_b}, survivor {rc_a} (end)",
            "leaving rank's share (B)": share,
            "sent to the peer (B)": int(sent[-1][0]) if sent else 0,
            "replica time (s)": float(sent[-1][1]) if sent else 0.0,
        }
        return row
    finally:
        c.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--two-tier", action="store_true", help="node loss with local tiers, with and without the replica")
    p.add_argument("--width", type=int, default=200_000, help="--two-tier: model width (state ~ 40 x width bytes)")
    p.add_argument("--rate", type=float, default=1e6, help="--two-tier: the remote's bandwidth after the signal (B/s)")
    args = p.parse_args()
    rows = []
    for _ in range(args.rounds):
        if args.two_tier:
            for replica in (False, True):
                with tempfile.TemporaryDirectory() as d:
                    rows.append(two_tier_leave(Path(d), replica=replica, width=args.width, rate=args.rate))
            continue
        for fn in (leave, join):
            with tempfile.TemporaryDirectory() as d:
                rows.append(fn(Path(d)))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    for event in sorted({str(r["event"]) for r in rows}):
        times = [float(r["training again (s)"]) for r in rows if r["event"] == event]
        print(f"{event}: training again after {statistics.median(times):.1f} s (median of {len(times)})")


if __name__ == "__main__":
    main()
