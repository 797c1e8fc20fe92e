"""Preemption costs: SIGTERM to exit of a real training process, the agreement, elastic resizes.

(a) A Lightning training process (real subprocess) holding ~1 GiB of state trains with
    ``PreemptionCallback`` + ``ShardedAsyncCheckpointIO``; after a few steps it gets SIGTERM:
    the time until it exits, exit code 143, and the newest committed checkpoint at the step it
    reported. "cold": no earlier save (the snapshot allocates its staging buffers); "warm": a
    periodic save committed before the signal.
(b) The agreement on ``--ranks`` gloo ranks, the engine's real ``PreemptionController`` with its
    defaults: a SIGTERM to rank 1 at a random moment after the cadence settled, the steps and
    seconds to the agreed step (target: <= 2 steps or <= 0.3 s); and its quiet cost per step.
(c) ``--elastic``: a node leaves and one joins under torchrun (2 simulated nodes): steps lost,
    seconds until training again.

    python benchmarks/bench_preempt.py            # (a) ~1 GiB state and (b), ~3 min
    python benchmarks/bench_preempt.py --quick    # 128 MiB, 2 trials, one step length
    python benchmarks/bench_preempt.py --elastic  # (c) too
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (
    MiB,
    header,
    launch,
    lightning_job,
    median,
    spawn_gloo,
    table,
    this_script,
    wait_until,
    workdir,
)

PREEMPT_EXIT = 143


# ---------------------------------------------------------------- (a) SIGTERM -> exit
def child_train(args: argparse.Namespace) -> int:
    """Train a ~``size_mib`` MiB MLP with SGD (no momentum: no optimizer state) until SIGTERM."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    Big, Noise = lightning_job()
    torch.manual_seed(0)
    width = 4096
    n_layers = max(1, round(args.size_mib * MiB / (4 * width * width)))

    class Status(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
            with open(os.path.join(args.status, "steps.jsonl"), "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "t": time.time()}) + "\n")

    cb = PreemptionCallback(args.dirpath, every_n_train_steps=args.every, keep_last_n=2, grace_period_s=60)
    trainer = L.Trainer(max_steps=10_000, accelerator="cpu", devices=1, callbacks=[cb, Status()],
                        plugins=[ShardedAsyncCheckpointIO()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    model = Big(width, n_layers, lr=1e-6)
    result: dict[str, Any] = {"n_params": sum(p.numel() for p in model.parameters())}
    try:
        trainer.fit(model, DataLoader(Noise(width), batch_size=4))
    except SystemExit as exc:
        origin = cb.signal_flag.received_at
        result.update(step=trainer.global_step, code=exc.code, exiting_at=time.time(),
                      timeline=[(event, t - origin if origin else None) for event, t in cb.timeline])  # fmt: skip
        with open(os.path.join(args.status, "result.json"), "w") as f:
            json.dump(result, f)
        raise
    return 0


def read_steps(status: str) -> list[dict[str, float]]:
    path = os.path.join(status, "steps.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def preempt_once(args: argparse.Namespace, root: str, scenario: str) -> dict[str, Any]:
    """Run one child, SIGTERM it after a few steps, measure, verify the checkpoint."""
    from lightning_preempt import list_checkpoints

    dirpath = os.path.join(root, f"{scenario}-ckpt")
    status = os.path.join(root, f"{scenario}-status")
    os.makedirs(status)
    every = 3 if scenario == "warm" else None
    cmd = [*this_script(__file__), "--child-train", "--dirpath", dirpath, "--status", status]
    cmd += ["--size-mib", str(args.size_mib)] + (["--every", str(every)] if every else [])
    log = os.path.join(root, f"{scenario}.log")
    proc = launch(cmd, log)
    signal_after = 6 if scenario == "warm" else 4

    def ready() -> bool:
        steps = read_steps(status)
        # warm: the periodic save must have committed (the buffers are warm)
        return bool(steps) and steps[-1]["step"] >= signal_after and (
            not every or any(c.committed for c in list_checkpoints(dirpath)))  # fmt: skip

    try:
        wait_until(ready, proc, args.timeout, poll_s=0.01)
        if proc.poll() is not None:
            raise RuntimeError(f"{scenario}: child exited early ({proc.returncode}); see {log}")
        t_kill = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=args.timeout)
        t_exit = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = read_steps(status)
    pre = [s for s in steps if s["t"] < t_kill]
    step_times = [b["t"] - a["t"] for a, b in itertools.pairwise(pre[1:])]  # skip the first (warm-up) step
    with open(os.path.join(status, "result.json")) as f:
        result = json.load(f)
    committed = [c for c in list_checkpoints(dirpath) if c.committed]
    newest = committed[0] if committed else None
    return {"scenario": scenario, "exit_s": t_exit - t_kill, "exit_code": code, "step_s": median(step_times),
            "n_steps_timed": len(step_times), "agreed_step": result["step"],
            "committed_step": newest.step if newest else None, "ckpt_bytes": newest.size_bytes if newest else None,
            "timeline": result["timeline"], "after_exiting_s": t_exit - result["exiting_at"],
            "n_params": result["n_params"]}  # fmt: skip


def sigterm_rows(runs: list[dict[str, Any]]) -> list[str]:
    rows, verdicts = [], []
    for r in runs:
        marks = {" ".join(event.split(" ")[:2]): t for event, t in r["timeline"] if t is not None}
        at = [next((t for e, t in marks.items() if e.startswith(m)), None) for m in ("ranks agreed", "staged step",
                                                                                     "committed step")]  # fmt: skip
        ok = r["exit_code"] == PREEMPT_EXIT and r["committed_step"] == r["agreed_step"]
        rows.append([r["scenario"], f"{r['exit_s']:.2f}", f"{r['step_s']:.3f} (n={r['n_steps_timed']})",
                     f"{r['exit_s'] / r['step_s']:.1f}", " / ".join("—" if t is None else f"{t:.2f}" for t in at),
                     f"{r['after_exiting_s']:.2f}", str(r["exit_code"]), f"{r['agreed_step']} / {r['committed_step']}",
                     "ok" if ok else "FAILED"])  # fmt: skip
        verdicts.append(f"- {r['scenario']}: exit code {r['exit_code']} (want {PREEMPT_EXIT}), committed step "
                        f"{r['committed_step']} == agreed step {r['agreed_step']}: {'met' if ok else 'MISSED'}")  # fmt: skip
    head = ["scenario", "SIGTERM->exit (s)", "step (s)", "exit / step", "agreed / staged / committed (s after signal)",
            "interpreter exit after `raise` (s)", "exit code", "agreed / committed step", "check"]  # fmt: skip
    return [f"(a) SIGTERM -> exit of a Lightning training process: {runs[0]['n_params'] / 1e6:.0f}M float32 params "
            f"(MLP, SGD), checkpoint {(runs[0]['ckpt_bytes'] or 0) / MiB:.0f} MiB; cold = no earlier save, warm = a "
            "periodic save (every 3 steps) committed before the signal.", "", table(head, rows), "", *verdicts, ""]  # fmt: skip


# ---------------------------------------------------------------- (b) the agreement
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


def _agree_worker(rank: int, world: int, cells: list[dict[str, Any]], out_dir: str) -> None:
    import torch

    from lightning_preempt.collective.groups import new_gloo_group

    group, grad = new_gloo_group(timeout_s=300), torch.zeros(1)
    results = []
    for cell in cells:
        rng = random.Random(cell["seed"])
        trials = [_trial(rank, cell["step_s"], group, grad, rng) for _ in range(cell["trials"])]
        quiet = _quiet(cell["step_s"], cell["quiet_steps"], cell["quiet_rounds"], group, grad)
        results.append({**cell, "trials": trials, "quiet": quiet})
    with open(os.path.join(out_dir, f"agree-rank{rank}.json"), "w") as f:
        json.dump(results, f)


def agreement(args: argparse.Namespace, root: str) -> list[str]:
    """(b) on ``--ranks`` ranks: each step length's signal-to-agreed-step trials and quiet cost."""
    cells = [{"step_s": s, "trials": args.trials, "seed": 58 + i, "quiet_steps": max(5, round(3.0 / s)),
              "quiet_rounds": 3} for i, s in enumerate(args.step_s)]  # fmt: skip
    spawn_gloo(_agree_worker, args.ranks, cells, root)
    ranks = [json.loads(Path(root, f"agree-rank{r}.json").read_text()) for r in range(args.ranks)]
    rows, cost_rows = [], []
    for i, cell in enumerate(ranks[1]):  # rank 1: the signalled one
        step_s, trials = cell["step_s"], cell["trials"]
        same = all(len({r[i]["trials"][t]["agreed_step"] for r in ranks}) == 1 for t in range(len(trials)))
        steps, secs = [t["steps"] for t in trials], [t["seconds"] for t in trials]
        within = sum(t["steps"] <= TARGET_STEPS or t["seconds"] <= max(TARGET_S, TARGET_STEPS * step_s) for t in trials)
        ledger = all(t["ledger_steps"] == t["steps"] for t in trials)
        rows.append([str(args.ranks), f"{step_s:g}", str(len(trials)), ", ".join(sorted({str(t["k"]) for t in trials})),
                     f"{max(steps)} / {median(steps):g}", f"{max(secs):.3f} / {median(secs):.3f}",
                     f"{within}/{len(trials)}", "yes" if same else "NO", "yes" if ledger else "NO"])  # fmt: skip
        q = cell["quiet"]
        none, agree = median(q["per_step"]["none"]), median(q["per_step"]["agree"])
        call = sum(q["in_call"]) / len(q["in_call"])
        cost_rows.append([str(args.ranks), f"{step_s:g}", str(q["k"]), f"{call * 1e3:.3f}", f"{call / step_s:.2%}",
                          f"{none * 1e3:.1f}", f"{agree * 1e3:.1f}", f"{(agree - none) / none:+.2%}"])  # fmt: skip
    return [
        "(b) Signal -> agreed step at a settled cadence (gloo ranks, a step = a sleep + a 1-element all-reduce; "
        "rank 1 gets a real SIGTERM at a random moment; steps: agreed step - the step before the signal):", "",
        table(["ranks", "step (s)", "trials", "k", "steps max / median", "seconds max / median",
               f"<= {TARGET_STEPS} steps or <= {TARGET_S} s", "same step on all ranks", "ledger figure = measured"],
              rows), "",
        "Quiet case (no signal): the training thread's time in the agreement per step, and the step time "
        "without / with it (medians of interleaved blocks):", "",
        table(["ranks", "step (s)", "k", "in agreement per step (ms)", "% of step", "step, none (ms)",
               "step, agreement (ms)", "difference"], cost_rows), "",
    ]  # fmt: skip


# ---------------------------------------------------------------- (c) elastic
def leave(tmp: Path) -> dict[str, float | int | str]:
    from elastic_cluster import Cluster  # tests/support, on the path through _harness

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
    from elastic_cluster import Cluster

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


def elastic(rounds: int) -> list[str]:
    """(c) a node leaves (2 -> 1) and one joins (1 -> 2) under torchrun (tests/support/elastic_cluster.py)."""
    rows = []
    for _ in range(rounds):
        for fn in (leave, join):
            with tempfile.TemporaryDirectory() as d:
                rows.append(fn(Path(d)))
    keys = list(rows[0])
    cells = [[f"{r[k]:.1f}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    return ["(c) Elastic resize, 2 simulated nodes (torchrun agents, c10d rendezvous on 127.0.0.1, one gloo rank "
            "each; seconds from the event):", "", table(keys, cells), ""]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="work dir (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=1024, help="(a) model size in MiB (default 1024)")
    p.add_argument("--ranks", type=int, default=2, help="(b) ranks (default 2)")
    p.add_argument("--step-s", type=float, nargs="+", default=[0.05, 0.5], help="(b) step lengths (default 0.05 0.5)")
    p.add_argument("--trials", type=int, default=5, help="(b) signals per step length (default 5)")
    p.add_argument("--elastic", action="store_true", help="(c) too: a node leaves and one joins under torchrun")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB model, (b) 2 trials of 0.05 s steps")
    p.add_argument("--timeout", type=float, default=180.0, help=argparse.SUPPRESS)
    p.add_argument("--child-train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dirpath", help=argparse.SUPPRESS)
    p.add_argument("--status", help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_train:
        return child_train(args)
    if args.quick:
        args.size_mib, args.trials, args.step_s = 128, 2, [0.05]
    started = time.perf_counter()
    with workdir(args.dir, "lp-bench-preempt-") as root:
        out = sigterm_rows([preempt_once(args, root, s) for s in ("cold", "warm")])
        out += agreement(args, root)
    out += elastic(1) if args.elastic else []
    print("\n".join(header("bench_preempt", f"run took {time.perf_counter() - started:.0f}s") + out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
