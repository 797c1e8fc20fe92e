"""Restart timeline: signal -> exit -> process start -> ... -> first step after resume.

A real Lightning job (MLP + SGD with momentum, ``PreemptionCallback``, the plugin) trains
until a periodic checkpoint has committed, gets SIGTERM (every rank, as a scheduler sends
it), snapshots and exits; the parent then starts the same job again at once, which
auto-resumes. The restarted job stamps wall-clock times at each phase:

* process start -> imports done (torch, lightning, lightning_preempt);
* -> rendezvous done (first ``setup`` hook: Lightning launched the ranks and the process
  group exists; 1 process: Trainer construction and the fit start-up);
* -> checkpoint chosen (``configure_model``, after our ``setup`` listed and picked it);
* -> checkpoint read (``on_load_checkpoint``: the load returned);
* -> training state restored (``on_train_start``);
* -> first step done (first ``on_train_batch_end``).

    python benchmarks/bench_restart.py                 # 512 MiB checkpoint, 1 and 2 ranks
    python benchmarks/bench_restart.py --quick         # 64 MiB, 1 rank
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: the restart's "process start"

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MiB, launch, machine_notes, median, read_json, table, this_script, wait_until, workdir  # noqa: E402

PHASES = [
    ("spawn", "start", "interpreter start (python + site)"),
    ("start", "imports", "imports (torch, lightning, lightning_preempt)"),
    ("imports", "rendezvous", "Trainer, launch the other ranks (their python + imports), process group"),
    ("rendezvous", "chosen", "list and choose the checkpoint (rank 0), broadcast"),
    ("chosen", "read", "read + verify the checkpoint (load_checkpoint)"),
    ("read", "restored", "restore model, optimizer, loops; on_train_start"),
    ("restored", "first_step", "first training step"),
]


# ---------------------------------------------------------------- child (the training job)
def child(args: argparse.Namespace) -> int:
    import lightning as L
    import torch
    from _models import Big, Noise
    from torch.utils.data import DataLoader

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    stamps: dict[str, float] = {"start": T_START, "imports": time.time()}
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    run = os.environ.get("LP_BENCH_RUN", "0")
    status = os.path.join(args.status, f"run{run}.rank{rank}.json")

    extras: dict[str, Any] = {"pid": os.getpid()}

    def stamp(name: str, **extra: Any) -> None:
        if name in stamps and name != "step":
            return
        stamps[name] = time.time()
        extras.update(extra)
        with open(status + ".tmp", "w") as f:
            json.dump({**extras, **stamps}, f)
        os.replace(status + ".tmp", status)

    torch.manual_seed(0)
    width = 2048
    # SGD with momentum: the checkpoint holds weights + one buffer per weight.
    n_layers = max(1, round(args.size_mib * MiB / 2 / (4 * width * width)))

    class Stamped(Big):
        def configure_model(self) -> None:
            stamp("chosen")

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            stamp("read")

    class Probe(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            stamp("rendezvous")

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            stamp("restored", start_step=trainer.global_step)

        def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
            stamp("first_step")
            stamp("step", step=trainer.global_step)

    cb = PreemptionCallback(args.dirpath, every_n_train_steps=args.every, keep_last_n=2, grace_period_s=60)
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.ranks,
        strategy="ddp" if args.ranks > 1 else "auto",
        callbacks=[Probe(), cb],
        plugins=[ShardedAsyncCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Stamped(width, n_layers, lr=1e-7, momentum=0.9), DataLoader(Noise(width), batch_size=4))
    return 0


# ---------------------------------------------------------------- parent
def read_status(status: str, run: int, rank: int) -> dict[str, Any]:
    return read_json(os.path.join(status, f"run{run}.rank{rank}.json"))


def start(args: argparse.Namespace, root: str, run: int, max_steps: int) -> tuple[subprocess.Popen[bytes], float]:
    cmd = [*this_script(__file__), "--child", "--dirpath", os.path.join(root, "ckpt"), "--status", root]
    cmd += ["--size-mib", str(args.size_mib), "--ranks", str(args.ranks), "--every", str(args.every)]
    cmd += ["--max-steps", str(max_steps)]
    t = time.time()
    return launch(cmd, os.path.join(root, f"run{run}.log"), env={**os.environ, "LP_BENCH_RUN": str(run)}), t


def wait_for(pred: Any, proc: subprocess.Popen[bytes], timeout: float, what: str) -> None:
    if not wait_until(pred, proc, timeout):
        proc.kill()
        raise RuntimeError(f"the job exited ({proc.poll()}) or timed out before {what}")


def one_restart(args: argparse.Namespace, root: str) -> dict[str, float]:
    from lightning_preempt import list_checkpoints

    ckpt = os.path.join(root, "ckpt")
    proc, _ = start(args, root, 0, 10_000)
    wait_for(lambda: any(c.committed for c in list_checkpoints(ckpt)), proc, args.timeout, "a periodic commit")
    wait_for(lambda: read_status(root, 0, 0).get("step", 0) >= args.every + 2, proc, args.timeout, "two more steps")
    pids = [read_status(root, 0, r).get("pid") for r in range(args.ranks)]
    t_signal = time.time()
    for pid in pids:  # the scheduler signals every process of the job
        if pid:
            os.kill(pid, signal.SIGTERM)
    code = proc.wait(timeout=args.timeout)
    t_exit = time.time()
    newest = next(c for c in list_checkpoints(ckpt) if c.committed)
    proc2, t_spawn = start(args, root, 1, newest.step + 3)
    wait_for(
        lambda: all("first_step" in read_status(root, 1, r) for r in range(args.ranks)),
        proc2,
        args.timeout,
        "the first step",
    )
    proc2.wait(timeout=args.timeout)
    ranks = [read_status(root, 1, r) for r in range(args.ranks)]
    # Rank 0 starts; Lightning's DDP launcher starts the other ranks once rank 0 built its
    # Trainer. From the rendezvous on, the slowest rank at each phase (the job's pace).
    stamps = {k: ranks[0][k] for k in ("start", "imports")}
    stamps |= {k: max(r[k] for r in ranks) for k in ("rendezvous", "chosen", "read", "restored", "first_step")}
    stamps["spawn"] = t_spawn
    out = {f"{a}->{b}": stamps[b] - stamps[a] for a, b, _ in PHASES}
    out["signal->exit"] = t_exit - t_signal
    out["exit->spawn"] = t_spawn - t_exit
    out["total"] = stamps["first_step"] - t_signal
    out["exit_code"] = float(code)
    out["resumed_step"] = float(ranks[0].get("start_step", -1))
    out["committed_step"] = float(newest.step)
    out["bytes"] = float(newest.size_bytes or 0)
    shutil.rmtree(ckpt, ignore_errors=True)
    for name in os.listdir(root):
        if name.startswith("run"):
            os.remove(os.path.join(root, name))
    return out


def run(args: argparse.Namespace) -> str:
    started = time.perf_counter()
    machine = machine_notes()
    with workdir(args.dir, "lp-bench-restart-") as root:
        results = [one_restart(args, root) for _ in range(args.repeats)]
    elapsed = time.perf_counter() - started

    def m(key: str) -> float:
        return median([r[key] for r in results])

    rows = [["SIGTERM -> process exited (snapshot committed)", f"{m('signal->exit'):.2f}", f"{m('signal->exit'):.2f}"]]
    cum = m("signal->exit") + m("exit->spawn")
    rows.append(
        ["exit -> restart launched (here: at once; a scheduler takes longer)", f"{m('exit->spawn'):.2f}", f"{cum:.2f}"]
    )
    for a, b, label in PHASES:
        cum += m(f"{a}->{b}")
        rows.append([label, f"{m(f'{a}->{b}'):.2f}", f"{cum:.2f}"])
    r0 = results[0]
    return "\n".join(
        [
            f"### bench_restart: {args.ranks} rank(s), checkpoint {r0['bytes'] / MiB:.0f} MiB, median of {args.repeats}",
            "",
            f"Machine: {machine}; run took {elapsed:.0f}s; loadavg at the end {os.getloadavg()[0]:.2f}",
            "",
            table(["phase", "seconds", "since the signal"], rows),
            "",
            f"Exit codes {sorted({int(r['exit_code']) for r in results})}; resumed at step "
            f"{sorted({int(r['resumed_step']) for r in results})} = the emergency snapshot's step "
            f"{sorted({int(r['committed_step']) for r in results})}; SIGTERM -> first step after resume "
            f"{m('total'):.2f} s (median).",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help="work dir, kept (default: a fresh dir under /tmp, removed)")
    p.add_argument("--dirpath", default="")
    p.add_argument("--status", default="")
    p.add_argument("--max-steps", type=int, default=10_000)
    p.add_argument("--size-mib", type=int, default=512, help="checkpoint size (weights + momentum), MiB")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--every", type=int, default=3, help="periodic save every N steps")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat")
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.quick:
        args.size_mib, args.repeats = 64, 1
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
