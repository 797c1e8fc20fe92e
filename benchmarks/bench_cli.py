"""How long the operator CLI takes, against the floor of starting Python at all.

100 small committed checkpoints (written by the plugin, as ``PreemptionCallback`` names
them) in a temporary directory; each command runs as a user runs it, in a new process
(the ``lightning-preempt`` console script), and is timed from spawn to exit:

* ``python -c pass``: the floor (interpreter start-up, site);
* ``python -c "import torch"``: what a command pays once it imports torch (for contrast);
* ``ls DIR``, ``ls DIR --json``: read and parse 100 manifests;
* ``ls DIR --verify``: also read every file of the 100 for its CRC32C;
* ``verify DIR``: the newest checkpoint's sizes, CRC32C, and that it loads without
  ``trust_checkpoints`` (replayed without torch);
* ``plan --from DIR ...``: the newest checkpoint's size and measured times into the plan.

Medians of ``--runs`` runs (after one warm-up each) of wall time and of the child's CPU
time (user + sys: on a loaded machine the steadier number); "x floor" is the ratio to
``python -c pass``.

    python benchmarks/bench_cli.py            # 100 checkpoints, 9 runs
    python benchmarks/bench_cli.py --quick    # 20 checkpoints, 3 runs
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from _harness import fmt_range, fmt_s, machine_notes, median, table

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.format.names import checkpoint_name


def write_checkpoints(root: str, count: int) -> None:
    """``count`` committed checkpoints of a small model with Adam, steps 100, 200, ..."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters())
    io = ShardedAsyncCheckpointIO()
    for i in range(1, count + 1):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        ckpt = {"epoch": 0, "global_step": 100 * i, "state_dict": model.state_dict(),
                "optimizer_states": [opt.state_dict()], "hyper_parameters": {"lr": 1e-3}}  # fmt: skip
        io.save_checkpoint(ckpt, os.path.join(root, checkpoint_name(100 * i)))
    io.teardown()


def cli() -> list[str]:
    """The installed console script, else ``python -m lightning_preempt.cli``."""
    script = os.path.join(os.path.dirname(sys.executable), "lightning-preempt")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "lightning_preempt.cli"]


def time_run(argv: Sequence[str], runs: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds) of ``runs`` runs of ``argv`` after one warm-up; fails loudly
    on an error. CPU time (user + sys of the child) hardly moves with the machine's load."""
    wall, cpu = [], []
    for i in range(runs + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")
        if i:  # the first run warms the page cache and .pyc files
            wall.append(elapsed)
            cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=100)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="20 checkpoints, 3 runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.checkpoints, args.runs = 20, 3

    scratch = tempfile.mkdtemp(prefix="lp-bench-cli-")
    root = os.path.join(scratch, "checkpoints")
    try:
        started = time.perf_counter()
        write_checkpoints(root, args.checkpoints)
        print(f"wrote {args.checkpoints} checkpoints in {time.perf_counter() - started:.1f}s", flush=True)
        lp = cli()
        commands = [
            ("python -c pass (floor)", [sys.executable, "-c", "pass"]),
            ('python -c "import torch"', [sys.executable, "-c", "import torch"]),
            (f"ls DIR ({args.checkpoints} checkpoints)", [*lp, "ls", root]),
            ("ls DIR --json", [*lp, "ls", root, "--json"]),
            ("ls DIR --verify (every file's CRC32C)", [*lp, "ls", root, "--verify"]),
            ("verify DIR (newest, incl. loads-without-trust)", [*lp, "verify", root]),
            ("plan --from DIR --mtbf 4h --write-bandwidth 1GB/s", [*lp, "plan", "--from", root, "--mtbf", "4h",
                                                                    "--write-bandwidth", "1GB/s"]),
        ]  # fmt: skip
        results = []
        for label, command in commands:
            wall, cpu = time_run(command, args.runs)
            results.append((label, wall, cpu))
            print(f"{label}: median {fmt_s(median(wall))} s wall, {fmt_s(median(cpu))} s CPU", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    floor_wall, floor_cpu = median(results[0][1]), median(results[0][2])
    rows = [
        [label, fmt_s(median(w)), fmt_range(w), f"{median(w) / floor_wall:.1f}x", fmt_s(median(c)),
         f"{median(c) / floor_cpu:.1f}x"]
        for label, w, c in results
    ]  # fmt: skip
    print()
    print(f"lightning-preempt start to exit, median of {args.runs} runs; x floor = ratio to `python -c pass`")
    print(machine_notes())
    print(table(["command", "wall (s)", "wall range (s)", "wall x floor", "CPU (s)", "CPU x floor"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
