"""Preemption costs: SIGTERM-to-exit of a real training process, and the per-step agreement.

(a) A Lightning training process (real subprocess) holding ~1 GiB of state trains with
    ``PreemptionCallback`` + ``ShardedAsyncCheckpointIO``; after a few steps we send
    SIGTERM and time until the process exits, check exit code 143 and that the newest
    committed checkpoint is at the step the process reported. Two scenarios: "cold" (no
    earlier save: the snapshot allocates its staging buffers) and "warm" (a periodic
    save already committed, as in a real run with periodic saves).
(b) With 2 gloo ranks (torch.multiprocessing), the per-step cost of
    ``FlagAgreement.exchange`` (overlap=False / True) next to a small DDP training step;
    blocks of steps with and without the exchange are interleaved, medians reported.

    python benchmarks/bench_preempt.py            # ~1 GiB state, ~2-3 min
    python benchmarks/bench_preempt.py --quick    # ~128 MiB state
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MiB, free_port, launch, machine_notes, median, ratio_table, table, this_script, wait_until, workdir

PREEMPT_EXIT = 143


# ---------------------------------------------------------------- (a) child: training
def child_train(args: argparse.Namespace) -> int:
    """Train a ~``size_mib`` MiB MLP with SGD (no momentum: no optimizer state) until SIGTERM."""
    import lightning as L
    import torch
    from _models import Big, Noise
    from torch.utils.data import DataLoader

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    torch.manual_seed(0)
    width = 4096
    n_layers = max(1, round(args.size_mib * MiB / (4 * width * width)))

    class Status(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
            with open(os.path.join(args.status, "steps.jsonl"), "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "t": time.time()}) + "\n")

    cb = PreemptionCallback(args.dirpath, every_n_train_steps=args.every, keep_last_n=2, grace_period_s=60)
    trainer = L.Trainer(
        max_steps=10_000,
        accelerator="cpu",
        devices=1,
        callbacks=[cb, Status()],
        plugins=[ShardedAsyncCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Big(width, n_layers, lr=1e-6)
    result: dict[str, Any] = {"n_params": sum(p.numel() for p in model.parameters())}
    try:
        trainer.fit(model, DataLoader(Noise(width), batch_size=4))
    except SystemExit as exc:
        origin = cb.signal_flag.received_at
        result.update(
            step=trainer.global_step,
            code=exc.code,
            timeline=[(event, t - origin if origin else None) for event, t in cb.timeline],
            exiting_at=time.time(),
        )
        with open(os.path.join(args.status, "result.json"), "w") as f:
            json.dump(result, f)
        if os.environ.get("LP_BENCH_TRACE_EXIT"):  # where the time after `raise` goes
            import faulthandler

            faulthandler.dump_traceback_later(0.3, repeat=True)
        raise
    return 0


# ---------------------------------------------------------------- (a) parent
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
    return {
        "scenario": scenario,
        "exit_s": t_exit - t_kill,
        "exit_code": code,
        "step_s": median(step_times),
        "n_steps_timed": len(step_times),
        "agreed_step": result["step"],
        "committed_step": newest.step if newest else None,
        "ckpt_bytes": newest.size_bytes if newest else None,
        "timeline": result["timeline"],
        "after_exiting_s": t_exit - result["exiting_at"],
        "n_params": result["n_params"],
    }


# ---------------------------------------------------------------- (b) agreement
def _agreement_worker(rank: int, world: int, port: int, steps: int, rounds: int, out_dir: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from lightning_preempt.collective import groups as pdist
    from lightning_preempt.collective.groups import FlagAgreement

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    group = pdist.new_gloo_group()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = torch.randn(64, 64), torch.randn(64, 1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    agreement = FlagAgreement(group, 2)
    modes = {"overlap=False": False, "overlap=True": True, "auto": True}
    times: dict[str, list[float]] = {"step": [], "exchange only": []}
    times.update({f"step + exchange {k}": [] for k in modes})
    t_warm = time.perf_counter()
    for _ in range(20):
        step()
    # What PreemptionCallback(agree_every_n_steps="auto") does: agree about every 0.25 s.
    k_tensor = torch.tensor([max(1, int(0.25 / ((time.perf_counter() - t_warm) / 20)))])
    dist.broadcast(k_tensor, src=0)
    every_k = int(k_tensor.item())
    for _ in range(rounds):
        for name in list(times):
            overlap = modes.get(name.removeprefix("step + exchange "))
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(steps):
                if name == "exchange only":
                    agreement.exchange([0, 0])
                    continue
                step()
                if overlap is not None and (not name.endswith("auto") or i % every_k == 0):
                    agreement.exchange([0, 0], overlap=overlap)
            agreement.flush()
            times[name].append((time.perf_counter() - t0) / steps)
    times["k (auto)"] = [float(every_k)]
    with open(os.path.join(out_dir, f"agree-rank{rank}.json"), "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()


def agreement_bench(args: argparse.Namespace, root: str) -> dict[str, list[float]]:
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_agreement_worker, args=(2, port, args.agree_steps, args.agree_rounds, root), nprocs=2, join=True)
    with open(os.path.join(root, "agree-rank0.json")) as f:
        times: dict[str, list[float]] = json.load(f)
    return times


# ---------------------------------------------------------------- report
def run(args: argparse.Namespace) -> str:
    out: list[str] = []
    started = time.perf_counter()
    with workdir(args.dir, "lp-bench-preempt-") as root:
        runs = [preempt_once(args, root, s) for s in ("cold", "warm")] if not args.skip_sigterm else []
        agree = agreement_bench(args, root) if not args.skip_agreement else {}
    elapsed = time.perf_counter() - started
    out += [
        f"### bench_preempt (run took {elapsed:.0f}s)",
        "",
        f"Machine: {machine_notes()}",
        "",
    ]
    verdicts = []
    if runs:
        out += [
            f"(a) SIGTERM -> exit of a Lightning training process: {runs[0]['n_params'] / 1e6:.0f}M float32 "
            f"params (MLP, SGD without momentum), checkpoint {((runs[0]['ckpt_bytes'] or 0) / MiB):.0f} MiB; "
            "cold = no earlier save, warm = a periodic save (every 3 steps) committed before the signal.",
            "",
        ]
        rows = []
        for r in runs:
            marks = {event.split(" ")[0] + " " + event.split(" ")[1]: t for event, t in r["timeline"] if t is not None}
            agreed = next((t for e, t in marks.items() if e.startswith("ranks agreed")), None)
            staged = next((t for e, t in marks.items() if e.startswith("staged step")), None)
            commit = next((t for e, t in marks.items() if e.startswith("committed step")), None)
            ok = r["exit_code"] == PREEMPT_EXIT and r["committed_step"] == r["agreed_step"]
            rows.append(
                [
                    r["scenario"],
                    f"{r['exit_s']:.2f}",
                    f"{r['step_s']:.3f} (n={r['n_steps_timed']})",
                    f"{r['exit_s'] / r['step_s']:.1f}",
                    " / ".join("—" if t is None else f"{t:.2f}" for t in (agreed, staged, commit)),
                    f"{r['after_exiting_s']:.2f}",
                    str(r["exit_code"]),
                    f"{r['agreed_step']} / {r['committed_step']}",
                    "ok" if ok else "FAILED",
                ]
            )
            verdicts.append(
                f"- {r['scenario']}: exit code {r['exit_code']} (want {PREEMPT_EXIT}), committed step "
                f"{r['committed_step']} == agreed step {r['agreed_step']}: {'met' if ok else 'MISSED'}"
            )
        out += [
            table(
                [
                    "scenario",
                    "SIGTERM->exit (s)",
                    "step (s)",
                    "exit / step",
                    "agreed / staged / committed (s after signal)",
                    "interpreter exit after `raise` (s)",
                    "exit code",
                    "agreed / committed step",
                    "check",
                ],
                rows,
            ),
            "",
        ]
    if agree:
        every_k = int(agree.pop("k (auto)", [0.0])[0])
        step = median(agree["step"])
        rows = [[name, f"{median(v) * 1e3:.3f}", f"{(median(v) - step) * 1e3:+.3f}"] for name, v in agree.items()]
        rows[1][2] = "—"
        out += [
            f"(b) Agreement collective, 2 gloo ranks, 1 thread each; small DDP step = MLP 64-256-256-1, batch 64, "
            f"SGD; {args.agree_rounds} interleaved rounds x {args.agree_steps} steps (median per step, rank 0)",
            "",
            table(["per step", "ms", "added vs step (ms)"], rows),
            "",
        ]
        out += [f'"auto" agreed every k={every_k} steps (about every 0.25 s), overlapped: the callback\'s default.', ""]
        checks = [(f"exchange cost {k} / small step", (median(agree[f"step + exchange {k}"]) - step) / step, 0.01, False)
                  for k in ("overlap=False", "overlap=True", "auto")]  # fmt: skip
        checks.append(("exchange alone / small step", median(agree["exchange only"]) / step, 0.01, False))
        out += [*ratio_table(checks, title=""), ""]
    out += verdicts
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="work dir (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=1024, help="model size in MiB (default 1024)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB model, fewer agreement steps")
    p.add_argument("--timeout", type=float, default=180.0, help="per child process (s)")
    p.add_argument("--agree-steps", type=int, default=300, help="steps per block in (b)")
    p.add_argument("--agree-rounds", type=int, default=5, help="interleaved rounds in (b)")
    p.add_argument("--skip-sigterm", action="store_true")
    p.add_argument("--skip-agreement", action="store_true")
    p.add_argument("--child-train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dirpath", help=argparse.SUPPRESS)
    p.add_argument("--status", help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_train:
        return child_train(args)
    if args.quick:
        args.size_mib, args.agree_steps, args.agree_rounds = 128, 100, 3
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
