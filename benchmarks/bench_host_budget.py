"""bench_save.py's host-memory section: peak staging memory and blocking under a budget.

Each row is a fresh process (benchmarks/budget_rss.py): the same state saved ``--repeats``
times with ``host_memory_budget`` unset (the default: half of MemAvailable per local rank,
which covers the state here), equal to the state, and half of it. Peak RSS growth is the
process's peak resident memory during the saves minus its RSS before them (``VmHWM`` reset
through ``/proc/self/clear_refs``): every byte the saves allocated, staging or not.

    python benchmarks/bench_save.py --host-budget                 # 1 GiB state
    python benchmarks/bench_save.py --host-budget --size-mib 64   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from _common import MiB, fmt_range, median, table

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(state_mib: int, budget_mib: int, tensors: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """One fresh process saving ``state_mib`` under ``budget_mib`` (0: the default budget)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="lp-bench-budget-", dir="/tmp") as out:
        cmd = [sys.executable, os.path.join(HERE, "budget_rss.py"), out, "--state-mib", str(state_mib),
               "--budget-mib", str(budget_mib), "--tensors", str(tensors), "--repeats", str(repeats),
               "--device", device]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"budget_rss.py failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_budget(args: argparse.Namespace) -> str:
    """The section's markdown: one row per budget, then the two checks of issue 25."""
    state = args.size_mib
    tensors = max(2, int(str(args.tensors).split(",")[0]))
    device = getattr(args, "device", None) or "cpu"
    rows: list[list[str]] = []
    got: dict[int, dict[str, Any]] = {}
    for label, budget in (("none given (default)", 0), ("= the state", state), ("= half the state", state // 2)):
        r = measure(state, budget, tensors, args.repeats, device)
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
        f"### Host-memory budget: {state} MiB in {tensors} float32 tensors on {device}, {args.repeats} saves per row "
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
