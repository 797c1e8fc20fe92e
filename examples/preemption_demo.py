"""Preemption simulator: train, get preempted at random, restart, and end bitwise identical.

Runs a small Lightning job (CPU, checkpoints on local disk under ``--out``) as a
subprocess, the way a cluster scheduler would:

1. an uninterrupted *reference* run of the same job;
2. the same job, preempted several times at random steps: ``SIGTERM`` (the callback
   snapshots and exits with 143, and the "scheduler" requeues it) or, with ``--sigkill N``,
   ``SIGKILL`` for N of them (no warning: the job resumes from the last periodic checkpoint).

Every restart is the *same command*; ``PreemptionCallback`` finds the newest valid
checkpoint and resumes. At the end it prints a report (steps lost per preemption, time
blocked per save, time from signal to exit, restart overhead) and checks that the final
weights equal the reference run's bit for bit. A plot of global step over wall time with
the preemptions marked goes to ``<out>/progress.png``. Last, ``lightning-preempt report`` reads
the run's goodput ledger (what preemption cost it) and draws ``<out>/timeline.png``.

    python examples/preemption_demo.py                 # ~1-2 min on 2 CPU cores
    python examples/preemption_demo.py --sigkill 1     # one of the preemptions is a SIGKILL
    python examples/preemption_demo.py --quick         # fewer steps and preemptions (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREEMPTED_EXIT = 143


# ---- the training job (runs in the child process) ---------------------------------------
def child_main(args: argparse.Namespace) -> int:
    """The job being preempted: an MLP with dropout on shuffled synthetic data."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_preempt.engine.ledger_writer
    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    # A short demo: the goodput ledger notes the last step seen at every step (default: every
    # 10 s), so the report counts a SIGKILL's lost steps exactly, as the demo's own table does.
    lightning_preempt.engine.ledger_writer.PROGRESS_EVERY_S = 0.0
    torch.set_num_threads(1)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    progress = open(run_dir / "progress.jsonl", "a", buffering=1)  # noqa: SIM115 (closed at exit)
    step_file = run_dir / "step"

    class Job(L.LightningModule):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, width),
                torch.nn.GELU(),
                torch.nn.Dropout(0.2),
                torch.nn.Linear(width, width),
                torch.nn.GELU(),
                torch.nn.Dropout(0.2),
                torch.nn.Linear(width, 1),
            )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            if args.step_time:
                time.sleep(args.step_time)  # stands in for a heavier model
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = self.trainer.global_step
            progress.write(json.dumps({"step": step, "t": time.time()}) + "\n")
            log_commits()
            tmp = step_file.with_suffix(".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, step_file)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    L.seed_everything(7, workers=True, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    y = (x[:, :8].sum(dim=1, keepdim=True)).sin() + 0.1 * torch.randn(2048, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

    callback = PreemptionCallback(args.ckpt_dir, every_n_train_steps=args.every, keep_last_n=2, grace_period_s=30)
    io = ShardedAsyncCheckpointIO()
    logged: set[int] = set()

    def log_commits() -> None:
        """Append newly committed saves to saves.jsonl (survives a later SIGKILL)."""
        with open(run_dir / "saves.jsonl", "a") as f:
            for i, r in enumerate(io.history):
                if r.committed_s is not None and i not in logged:
                    logged.add(i)
                    rec = {"step": r.step, "blocking_s": r.blocking_s, "committed_s": r.committed_s, "bytes": r.bytes}
                    f.write(json.dumps(dict(rec, t=time.time())) + "\n")

    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        plugins=[io],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    model = Job(args.width)
    started = time.monotonic()
    code = 0
    try:
        trainer.fit(model, loader)
        torch.save(model.state_dict(), run_dir / "final_weights.pt")
    except SystemExit as exc:  # Preempted: the callback snapshotted; exit with its code
        code = int(exc.code or 0)
        raise
    finally:
        received = callback.signal_flag.received_at
        exit_at = next((t for event, t in callback.timeline if event.startswith("exiting")), None)
        record = {
            "pid": os.getpid(),
            "resumed_from": callback.resumed_from,
            "start_step": _step_of(callback.resumed_from),
            "end_step": trainer.global_step,
            "exit_code": code,
            "signal_to_exit_s": (exit_at - received) if received is not None and exit_at is not None else None,
            "startup_s": time.monotonic() - started,
            "saves": [
                {"step": r.step, "blocking_s": r.blocking_s, "committed_s": r.committed_s, "bytes": r.bytes}
                for r in io.history
            ],
            "emergency_step": trainer.global_step if received is not None else None,
        }
        with open(run_dir / "runs.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        log_commits()
        progress.close()
    return 0


def _step_of(path: str | None) -> int:
    if not path:
        return 0
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return int(name.split("-")[-1]) if name.startswith("step-") else 0


# ---- the scheduler (parent process) ------------------------------------------------------
@dataclass
class Preemption:
    signal: str
    target_step: int  # the step after which we sent the signal
    signalled_at: float = 0.0  # wall time
    exited_at: float = 0.0
    exit_code: int | None = None
    last_step: int = 0  # last step trained before the process died
    resumed_at: int = 0  # the step the next run resumed from
    first_step_after: float = 0.0  # wall time of the first trained step after the restart
    child: dict[str, Any] = field(default_factory=dict)


def _read_step(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return -1


def _progress(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "progress.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _runs(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _saves(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "saves.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _child_cmd(args: argparse.Namespace, run_dir: Path, ckpt_dir: Path) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--run-dir",
        str(run_dir),
        "--ckpt-dir",
        str(ckpt_dir),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--width",
        str(args.width),
        "--step-time",
        str(args.step_time),
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_job(
    args: argparse.Namespace,
    name: str,
    plan: list[Preemption],
    bar: Any,
) -> tuple[Path, list[Preemption], float]:
    """Run the job to completion, delivering ``plan``'s signals; restart after each."""
    run_dir = Path(args.out) / name
    ckpt_dir = Path(args.out) / f"{name}-ckpt"
    for d in (run_dir, ckpt_dir):
        shutil.rmtree(d, ignore_errors=True)
    run_dir.mkdir(parents=True)
    logs = run_dir / "logs"
    logs.mkdir()
    step_file = run_dir / "step"
    started = time.time()
    pending = list(plan)
    attempt = 0
    while True:
        attempt += 1
        step_file.unlink(missing_ok=True)
        with open(logs / f"attempt-{attempt}.log", "wb") as log:
            proc = subprocess.Popen(
                _child_cmd(args, run_dir, ckpt_dir), stdout=log, stderr=subprocess.STDOUT, env=_env()
            )
            current = pending[0] if pending else None
            shown = bar.n
            while proc.poll() is None:
                step = _read_step(step_file)
                if step > shown or 0 <= step < shown:
                    bar.update(step - shown)
                    shown = step
                if current is not None and step >= current.target_step:
                    current.signalled_at = time.time()
                    proc.send_signal(signal.SIGTERM if current.signal == "SIGTERM" else signal.SIGKILL)
                    proc.wait()
                    current.exited_at = time.time()
                    break
                time.sleep(0.01)
            proc.wait()
        code = proc.returncode
        if current is not None and current.exited_at:
            current.exit_code = code
            runs = _runs(run_dir)
            current.child = runs[-1] if runs and code == PREEMPTED_EXIT else {}
            # The snapshot step was trained but the job exits before logging its progress.
            logged = max((p["step"] for p in _progress(run_dir)), default=0)
            current.last_step = max(logged, int(current.child.get("end_step") or 0))
            pending.pop(0)
            bar.set_postfix_str(f"preemptions {len(plan) - len(pending)}/{len(plan)}")
            if code in (PREEMPTED_EXIT, -signal.SIGKILL):
                continue  # the scheduler requeues the job: same command, it resumes by itself
        if code != 0:
            tail = (logs / f"attempt-{attempt}.log").read_text()[-3000:]
            raise SystemExit(f"the training job failed with exit code {code}:\n{tail}\nHINT: see {logs}")
        bar.update(args.steps - shown)
        break
    return run_dir, plan, time.time() - started


def make_plan(args: argparse.Namespace) -> list[Preemption]:
    rng = random.Random(args.seed)
    n = args.preemptions
    lo, hi = int(args.steps * 0.1), int(args.steps * 0.9)
    width = max(1, (hi - lo) // max(n, 1))
    targets = [lo + i * width + rng.randrange(max(1, width - 2)) for i in range(n)]
    kills = set(rng.sample(range(n), min(args.sigkill, n)))
    return [Preemption("SIGKILL" if i in kills else "SIGTERM", t) for i, t in enumerate(targets)]


def _fill_restarts(run_dir: Path, plan: list[Preemption]) -> None:
    """Where each restart resumed and when it trained its first step (from the job's progress log)."""
    progress = _progress(run_dir)
    for pre in plan:
        after = [p for p in progress if p["t"] > pre.exited_at]
        if after:  # progress logs the global step *after* each batch: the first one is resume + 1
            pre.resumed_at = after[0]["step"] - 1
            pre.first_step_after = after[0]["t"]
        else:
            pre.resumed_at, pre.first_step_after = pre.last_step, pre.exited_at


def plot(out: Path, ref_dir: Path, run_dir: Path, plan: list[Preemption], ref_start: float, start: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    ref = _progress(ref_dir)
    ax.plot([p["t"] - ref_start for p in ref], [p["step"] for p in ref], color="0.6", lw=1.5, ls="--",
            label="uninterrupted reference")  # fmt: skip
    prog = _progress(run_dir)
    # one line per attempt of the job (a gap while it is down)
    exits = sorted(pre.exited_at for pre in plan)
    segments: dict[int, list[dict[str, Any]]] = {}
    for p in prog:
        segments.setdefault(sum(t < p["t"] for t in exits), []).append(p)
    for k, seg in enumerate(segments.values()):
        ax.plot([p["t"] - start for p in seg], [p["step"] for p in seg], color="tab:blue", lw=2,
                label="preempted job (restarted after each preemption)" if k == 0 else None)  # fmt: skip
    for i, pre in enumerate(plan):
        color = "tab:red" if pre.signal == "SIGTERM" else "black"
        ax.axvline(pre.signalled_at - start, color=color, lw=1, ls=":")
        ax.axvspan(pre.signalled_at - start, pre.first_step_after - start, color=color, alpha=0.08)
        lost = pre.last_step - pre.resumed_at
        ax.annotate(
            f"{pre.signal}\nstep {pre.last_step}" + (f"\n{lost} lost" if lost > 0 else ""),
            (pre.signalled_at - start, pre.last_step),
            xytext=(4, -30 if i % 2 else 8),
            textcoords="offset points",
            fontsize=8,
            color=color,
        )
    # committed checkpoints (periodic and snapshots) on the preempted run's line
    when: dict[int, float] = {}
    for p in prog:
        when.setdefault(p["step"], p["t"] - start)
    for pre in plan:  # a snapshot's step is trained but not logged: the job exits first
        if pre.child.get("end_step"):
            when.setdefault(int(pre.child["end_step"]), pre.signalled_at - start)
    saved = sorted({s["step"] for s in _saves(run_dir)})
    pts = [(when[s], s) for s in saved if s in when]
    if pts:
        ax.plot(*zip(*pts, strict=True), "o", color="tab:green", ms=4, label="checkpoint committed", zorder=3)
    ax.set_xlim(left=0)
    ax.set_xlabel("wall time since the job was first started (s)")
    ax.set_ylabel("global step")
    ax.set_title("Training through preemptions (shaded: job down until its first step after restart)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = out / "progress.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def compare_weights(a: Path, b: Path) -> tuple[bool, int]:
    import torch

    wa = torch.load(a, weights_only=True)
    wb = torch.load(b, weights_only=True)
    same = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return same, len(wa)


def report(args: argparse.Namespace, plan: list[Preemption], run_dir: Path, ref_wall: float, wall: float) -> bool:
    runs = _runs(run_dir)
    saves = _saves(run_dir)
    emergency = {(r["emergency_step"]) for r in runs if r.get("emergency_step") is not None}
    periodic = [s for s in saves if s["step"] not in emergency]
    snapshots = [s for s in saves if s["step"] in emergency]
    print()
    print(f"Preemptions: {len(plan)}  ({sum(p.signal == 'SIGTERM' for p in plan)} SIGTERM, "
          f"{sum(p.signal == 'SIGKILL' for p in plan)} SIGKILL)")  # fmt: skip
    header = f"{'#':>2}  {'signal':7}  {'at step':>7}  {'exit':>4}  {'resumed at':>10}  {'steps lost':>10}  "
    header += f"{'snapshot blocked':>16}  {'signal->exit':>12}  {'->process gone':>14}  {'down':>8}"
    print(header)
    for i, p in enumerate(plan, 1):
        lost = max(0, p.last_step - p.resumed_at)
        snap = next((s for s in p.child.get("saves", []) if s["step"] == p.child.get("emergency_step")), None)
        blocked = f"{snap['blocking_s'] * 1000:.1f} ms" if snap else "-"
        in_job = p.child.get("signal_to_exit_s")
        to_exit = f"{in_job:.2f} s" if in_job is not None else "-"
        # the report's DOWN: from the exit call (a SIGKILL: the kill) to the next first step
        down = p.first_step_after - p.signalled_at - (in_job or 0.0)
        print(
            f"{i:>2}  {p.signal:7}  {p.last_step:>7}  {p.exit_code if p.exit_code is not None else '?':>4}  "
            f"{p.resumed_at:>10}  {lost:>10}  {blocked:>16}  {to_exit:>12}  "
            f"{p.exited_at - p.signalled_at:>12.2f} s  {down:>6.1f} s"
        )
    print(
        "  signal->exit: in the job, from the signal to raising the exit (ranks agree, snapshot, commit);\n"
        "  ->process gone: until the process ended (adds Lightning teardown and interpreter exit);\n"
        "  down: from the exit call to the restarted job's first step (teardown, restart, then mostly importing\n"
        "  torch and Lightning), as `lightning-preempt report` counts it."
    )
    total_lost = sum(max(0, p.last_step - p.resumed_at) for p in plan)
    print(f"Steps lost in total: {total_lost} (SIGTERM snapshots lose none; a SIGKILL loses the steps since "
          f"the last periodic save, every {args.every} steps)")  # fmt: skip
    if periodic:
        blocked_ms = [s["blocking_s"] * 1000 for s in periodic]
        committed = [s["committed_s"] for s in periodic if s["committed_s"]]
        print(
            f"Periodic saves: {len(periodic)} of {periodic[0]['bytes'] / 1e6:.1f} MB; training blocked "
            f"{statistics.median(blocked_ms):.1f} ms median (max {max(blocked_ms):.1f} ms); committed after "
            f"{statistics.median(committed):.2f} s median in the background"
        )
    if snapshots:
        print(
            "Emergency snapshots: blocked "
            + ", ".join(f"{s['blocking_s'] * 1000:.1f} ms" for s in snapshots)
            + "; committed after "
            + ", ".join(f"{s['committed_s']:.2f} s" for s in snapshots if s["committed_s"])
        )
    print(f"Wall time: {wall:.1f} s with preemptions, {ref_wall:.1f} s uninterrupted "
          f"(most of the difference is process start-up: importing torch/Lightning)")  # fmt: skip
    same, n = compare_weights(Path(args.out) / "reference" / "final_weights.pt", run_dir / "final_weights.pt")
    verdict = "IDENTICAL to" if same else "DIFFERENT from"
    print(f"Final weights: {verdict} the uninterrupted run (bitwise, {n} tensors)")
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="demo_out", help="output directory (checkpoints, logs, progress.png)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200, --quick 40)")
    p.add_argument("--preemptions", type=int, default=None, help="how many preemptions (default 4, --quick 2)")
    p.add_argument("--sigkill", type=int, default=0, help="how many of them are SIGKILL instead of SIGTERM")
    p.add_argument("--every", type=int, default=None, help="periodic checkpoint every N steps (default 20)")
    p.add_argument("--seed", type=int, default=None, help="seed for the preemption times (default: random)")
    p.add_argument("--quick", action="store_true", help="a short run (for tests)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=768, help=argparse.SUPPRESS)
    p.add_argument("--step-time", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)

    args.steps = args.steps or (40 if args.quick else 200)
    args.preemptions = args.preemptions if args.preemptions is not None else (2 if args.quick else 4)
    args.every = args.every or (10 if args.quick else 20)
    args.step_time = args.step_time if args.step_time is not None else (0.02 if args.quick else 0.03)
    if args.quick:
        args.width = min(args.width, 256)
    if args.sigkill > args.preemptions:
        p.error(f"--sigkill {args.sigkill} is more than --preemptions {args.preemptions}")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    try:
        from tqdm import tqdm
    except ImportError:
        raise SystemExit("the demo needs tqdm and matplotlib\nHINT: pip install -e '.[demo]'") from None

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args)
    print(
        f"lightning_preempt demo: {args.steps} steps of an MLP with dropout on CPU, checkpoints every {args.every} "
        f"steps under {out}/\nPreemption plan (seed {args.seed}): "
        + ", ".join(f"{pre.signal} after step {pre.target_step}" for pre in plan)
    )
    with tqdm(total=args.steps, desc="reference run (no preemption)", unit="step", dynamic_ncols=True) as bar:
        ref_start = time.time()
        ref_dir, _, ref_wall = run_job(args, "reference", [], bar)
    with tqdm(total=args.steps, desc="preempted run", unit="step", dynamic_ncols=True) as bar:
        start = time.time()
        run_dir, plan, wall = run_job(args, "preempted", plan, bar)
    _fill_restarts(run_dir, plan)
    same = report(args, plan, run_dir, ref_wall, wall)
    png = plot(out, ref_dir, run_dir, plan, ref_start, start)
    print(f"Plot: {png}")
    ckpt_dir = out / "preempted-ckpt"
    timeline = out / "timeline.png"
    print(f"\n$ lightning-preempt report {ckpt_dir} --plot {timeline}")
    sys.stdout.flush()
    from lightning_preempt.cli import main as cli

    reported = cli(["report", str(ckpt_dir), "--plot", str(timeline)])
    return 0 if same and reported == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
