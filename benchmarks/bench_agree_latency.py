"""Signal -> agreed step, and the agreement's own cost, at a settled cadence (issue 58).

Ranks (gloo, one process each, torch.multiprocessing) run a loop of steps of a chosen length:
a sleep (the host waits for the GPU's step) and a 1-element all-reduce on the default group
(DDP's gradient sync keeps the ranks in step). After every step, the real
``PreemptionController`` of the engine agrees with its defaults (``agree_every_n_steps="auto"``,
``agree_interval_s=0.3``, ``overlap_agreement=True``) on its own gloo group.

* Trials: one rank (rank 1) gets a real SIGTERM from a timer at a random moment after the
  cadence settled (after the 20 calibration steps and a few more); every rank runs until the
  controller says "preempt". Per trial: the steps from the step before the signal to the
  agreed step, and the seconds from the signal to the agreed step on the signalled rank's
  clock (and the figures the ledger records, from the agreement itself). Target (issue 58):
  <= 2 steps or <= 0.3 s, whichever is longer.
* Quiet cost: blocks of steps without any agreement and with it (no signal), interleaved;
  per step the time the training thread spends in ``at_boundary`` and the step time.

    python benchmarks/bench_agree_latency.py                          # 5 trials at 2 ranks, 3 at 4
    python benchmarks/bench_agree_latency.py --trials 20 --trials4 20  # the issue's count

Benchmarks never assert on time: the table says what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, machine_notes, median, table

SETTLE_STEPS = 26  # the 20 calibration steps, the proposal read, a few more
TARGET_STEPS, TARGET_S = 2, 0.3


def _step(step_s: float, grad: Any) -> None:
    import torch.distributed as dist

    time.sleep(step_s)  # the GPU computes; the host waits
    dist.all_reduce(grad)  # DDP's gradient sync: the ranks stay in step


def _controller(group: Any) -> Any:
    from lightning_preempt.engine.config import PreemptionConfig
    from lightning_preempt.preemption.controller import PreemptionController

    controller = PreemptionController(PreemptionConfig(dirpath="memory://bench-agree", signals=("SIGTERM",)))
    controller.bind(group)
    controller.start()
    return controller


def _trial(rank: int, step_s: float, group: Any, grad: Any, rng: random.Random) -> dict[str, Any]:
    controller = _controller(group)
    times: list[float] = []
    timer = None
    step = 0
    while True:
        _step(step_s, grad)
        step += 1
        now = time.monotonic()
        times.append(now)
        if rank == 1 and step == SETTLE_STEPS:
            # a random moment within the next 2 exchanges' worth of steps (k <= 6 here)
            timer = threading.Timer(rng.random() * 12 * step_s, os.kill, (os.getpid(), signal.SIGTERM))
            timer.start()
        if controller.at_boundary(now, save_due=False, stop=False).preempt:
            break
    controller.flush()
    if timer is not None:
        timer.join()
    received = controller.signal_flag.received_at
    controller.stop()
    steps, seconds = controller.agreed_after
    out: dict[str, Any] = {"k": controller.schedule.k, "agreed_step": step, "ledger_steps": steps, "ledger_s": seconds}
    if received is not None:
        before = sum(1 for t in times if t <= received)  # steps completed when the signal came
        out.update(signal_step=before, steps=step - before, seconds=times[-1] - received)
    return out


def _quiet(step_s: float, steps: int, rounds: int, group: Any, grad: Any) -> dict[str, Any]:
    """Interleaved blocks of ``steps`` steps without and with the agreement (no signal)."""
    import torch.distributed as dist

    controller = _controller(group)
    for _ in range(SETTLE_STEPS):  # calibrated and settled before timing
        _step(step_s, grad)
        controller.at_boundary(time.monotonic(), save_due=False, stop=False)
    per_step: dict[str, list[float]] = {"none": [], "agree": []}
    in_call: list[float] = []
    for rnd in range(rounds):
        for mode in (("none", "agree") if rnd % 2 == 0 else ("agree", "none")):
            controller.flush()
            dist.barrier()
            spent = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                _step(step_s, grad)
                if mode == "agree":
                    t = time.perf_counter()
                    controller.at_boundary(time.monotonic(), save_due=False, stop=False)
                    spent += time.perf_counter() - t
            per_step[mode].append((time.perf_counter() - t0) / steps)
            if mode == "agree":
                in_call.append(spent / steps)
    controller.flush()
    controller.stop()
    return {"k": controller.schedule.k, "per_step": per_step, "in_call": in_call}


def _worker(rank: int, world: int, port: int, cells: list[dict[str, Any]], out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_preempt.collective.groups import new_gloo_group

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    group = new_gloo_group(timeout_s=300)
    grad = torch.zeros(1)
    results = []
    for cell in cells:
        rng = random.Random(cell["seed"])
        trials = [_trial(rank, cell["step_s"], group, grad, rng) for _ in range(cell["trials"])]
        quiet = _quiet(cell["step_s"], cell["quiet_steps"], cell["quiet_rounds"], group, grad)
        results.append({**cell, "trials": trials, "quiet": quiet})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def run_world(world: int, cells: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Every cell on ``world`` ranks; each rank's results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lp-bench-agree-") as root:
        mp.spawn(_worker, args=(world, free_port(), cells, root), nprocs=world, join=True)
        return [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in range(world)]


def _within(trial: dict[str, Any], step_s: float) -> bool:
    return bool(trial["steps"] <= TARGET_STEPS or trial["seconds"] <= max(TARGET_S, TARGET_STEPS * step_s))


def report(worlds: dict[int, list[list[dict[str, Any]]]], took: float) -> str:
    rows, cost_rows = [], []
    for world, ranks in worlds.items():
        for i, cell in enumerate(ranks[1]):  # rank 1: the signalled one
            step_s, trials = cell["step_s"], cell["trials"]
            agreed = {tuple(r[i]["trials"][t]["agreed_step"] for r in ranks) for t in range(len(trials))}
            same = all(len(set(steps)) == 1 for steps in agreed)
            steps = [t["steps"] for t in trials]
            secs = [t["seconds"] for t in trials]
            ledger = all(t["ledger_steps"] == t["steps"] for t in trials)
            rows.append([str(world), f"{step_s:g}", str(len(trials)), ", ".join(sorted({str(t["k"]) for t in trials})),
                         f"{max(steps)} / {median(steps):g}", f"{max(secs):.3f} / {median(secs):.3f}",
                         f"{sum(_within(t, step_s) for t in trials)}/{len(trials)}",
                         "yes" if same else "NO", "yes" if ledger else "NO"])  # fmt: skip
            q = cell["quiet"]
            none, agree = median(q["per_step"]["none"]), median(q["per_step"]["agree"])
            call = sum(q["in_call"]) / len(q["in_call"])
            cost_rows.append([str(world), f"{step_s:g}", str(q["k"]), f"{call * 1e3:.3f}", f"{call / step_s:.2%}",
                              f"{none * 1e3:.1f}", f"{agree * 1e3:.1f}", f"{(agree - none) / none:+.2%}"])  # fmt: skip
    return "\n".join([
        f"### bench_agree_latency (run took {took:.0f}s)", "", f"Machine: {machine_notes()}", "",
        "Signal -> agreed step at a settled cadence (rank 1 gets a real SIGTERM at a random moment; "
        "steps: agreed step - the step before the signal; seconds: signal to the agreed step's boundary):", "",
        table(["ranks", "step (s)", "trials", "k", "steps max / median", "seconds max / median",
               f"<= {TARGET_STEPS} steps or <= {TARGET_S} s", "same step on all ranks", "ledger figure = measured"],
              rows),
        "",
        "Quiet case (no signal): the training thread's time in the agreement per step, and the step time "
        "without / with the agreement (medians of interleaved blocks; the step is a sleep + a 1-element all-reduce):",
        "",
        table(["ranks", "step (s)", "k", "in agreement per step (ms)", "% of step", "step, none (ms)",
               "step, agreement (ms)", "difference"], cost_rows),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--step-s", type=float, nargs="+", default=[0.05, 0.5])
    p.add_argument("--trials", type=int, default=5, help="trials per step length at 2 ranks")
    p.add_argument("--trials4", type=int, default=3, help="trials per step length at more than 2 ranks")
    p.add_argument("--quiet-s", type=float, default=3.0, help="seconds of steps per quiet-case block")
    p.add_argument("--quiet-rounds", type=int, default=3)
    args = p.parse_args(argv)
    started = time.perf_counter()
    worlds = {}
    for world in args.ranks:
        cells = [{"step_s": s, "trials": args.trials if world <= 2 else args.trials4, "seed": 58 + i,
                  "quiet_steps": max(5, round(args.quiet_s / s)), "quiet_rounds": args.quiet_rounds}
                 for i, s in enumerate(args.step_s)]  # fmt: skip
        worlds[world] = run_world(world, cells)
    print(report(worlds, time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
