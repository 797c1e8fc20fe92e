"""Tier 0 (docs/tier0.md): what it costs and what it buys, as one ratio table.

* **Step-time overhead** at ``tier0_every_n_steps`` (default ``auto``), three ways. (1) Wall
  clock: fits with and without tier 0 in ``--pairs`` ABBA pairs, the mean step time after the
  warm-up (copies amortised in it); the median of the pairs' ratios with a distribution-free
  ~90 % interval (order statistics). On a shared host it moves +-25 %: read the interval.
  (2) The training thread's own time in tier 0's calls (``Engine.save_memory``: path choice
  and staging; ``MemoryTier.vote`` at every boundary), timed around them: what a step waits
  for tier 0, as a fraction of the timed steps' wall time and per copy at the chosen K. This
  is the overhead when the writer and the seal run on cores training does not use (a GPU
  host); it is robust to load. (3) The process's CPU time over the same steps, tier 0 / none:
  the writer's and the seal's CPU, which compete with training where the cores are few.
  Target <= 1 %.
* **Restart** from tier 0 against the same restart from the local disk tier (the same state at
  the same step, written by the same kind of fit): a fresh process resuming it, measured twice
  — process start to the first training step (what a user waits for), and the resume part
  alone (the ``fit`` call to the first step: set-up, choice, load). The disk tier warm (its
  pages still in the page cache, as after a SIGKILL on a host with memory to spare) and cold
  (the checkpoint's pages evicted with ``posix_fadvise(DONTNEED)``, as on a host whose cache
  was reclaimed). Target <= 0.5x. The tier-0 copy is sealed after it commits (read/seal.py),
  so its resume skips the second CRC32C pass; the disk checkpoint is checked in full. The
  fair comparison for a process lost without a signal is tier 0 against the disk cold.
* **Memory**: tier 0's tmpfs use (sampled every 20 ms while the tier-0 fit runs: peak and at
  the end) and the process's peak RSS, against the budget of tier 0 on one node: its own copy
  plus one peer's (2 x one copy's bytes).

Each fit runs in its own process (``--child``), so RSS and start-up are the process's own.

    python benchmarks/bench_tier0.py --mb 32 --steps 150 --step-sleep 0.05 --pairs 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _common import machine_notes, table

WARMUP = 10  # steps left out of the step time (imports done, buffers allocated)


# ---- the child: one fit --------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    import resource

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO
    from lightning_preempt.engine.engine import Engine
    from lightning_preempt.engine.memory_tier import MemoryTier

    # The training thread's own time in tier 0's calls (the vote at every boundary, the copy's
    # path choice and staging): wall and this thread's CPU, per call.
    calls: list[tuple[str, float, float]] = []

    def timed(cls: Any, name: str) -> None:
        fn = getattr(cls, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                calls.append((name, time.perf_counter() - w, time.thread_time() - c))

        setattr(cls, name, wrapper)

    timed(Engine, "save_memory")
    timed(MemoryTier, "vote")

    n = int((args.mb * 2**20 / 4) ** 0.5)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(n, n, bias=False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(args.step_sleep)
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Clock(Callback):
        def __init__(self) -> None:
            self.ends: list[tuple[float, float, int]] = []  # perf_counter, process CPU, calls so far
            self.first_step_t = self.first_step_cpu = 0.0

        def on_train_batch_start(self, trainer: L.Trainer, *a: Any) -> None:
            if not self.first_step_t:
                self.first_step_t, self.first_step_cpu = time.time(), time.process_time()
                if args.stop_at_first_step:
                    trainer.should_stop = True  # a restart's measure ends at the first step

        def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
            self.ends.append((time.perf_counter(), time.process_time(), len(calls)))

    tier0: Any = None if args.tier0 == "off" else ("auto" if args.tier0 == "auto" else int(args.tier0))
    cb = PreemptionCallback(args.dirpath, every_n_train_steps=args.every, keep_last_n=2, lease=False, ledger=False,
                            log_metrics=False, save_on_train_end=False, tier0_every_n_steps=tier0,
                            memory_dirpath=args.memory if tier0 is not None else None)  # fmt: skip
    clock = Clock()
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, callbacks=[cb, clock], logger=False,
                        plugins=[ShardedAsyncCheckpointIO()], enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False)  # fmt: skip
    loader = DataLoader(TensorDataset(torch.randn(args.steps * 4 + 8, n)), batch_size=4)
    fit_t, fit_cpu = time.time(), time.process_time()
    trainer.fit(Model(), loader)
    gaps = [b[0] - a[0] for a, b in zip(clock.ends[WARMUP:], clock.ends[WARMUP + 1 :], strict=False)]
    memory = cb.engine.memory
    copies = [r for r in cb.engine.saver.history if memory is not None and r.path.startswith(memory.root)]
    first, last = clock.ends[WARMUP] if len(clock.ends) > WARMUP else clock.ends[0], clock.ends[-1]
    window = calls[first[2] : last[2]]  # the timed steps' calls
    stages = [w for name, w, _ in window if name == "save_memory"]
    print("RESULT " + json.dumps({
        "fit_t": fit_t, "first_step_t": clock.first_step_t, "resume_cpu": clock.first_step_cpu - fit_cpu, "step_s": statistics.fmean(gaps) if gaps else None,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "resumed_from": cb.resumed_from,
        "k": memory.every if memory is not None else None, "copies": len(copies),
        "copy_s": statistics.median(r.committed_s for r in copies if r.committed_s) if copies else None,
        "window_s": last[0] - first[0], "cpu_s": last[1] - first[1], "blocked_s": sum(w for _, w, _ in window),
        "blocked_cpu_s": sum(c for _, _, c in window), "stage_s": statistics.median(stages) if stages else None,
        "vote_s": statistics.median([w for name, w, _ in window if name == "vote"] or [0.0]),
    }), flush=True)  # fmt: skip


# ---- the parent ------------------------------------------------------------------------------
def run_child(args: argparse.Namespace, **over: Any) -> tuple[dict[str, Any], float]:
    """One fit in a fresh process: its RESULT and the wall time it was started at."""
    opts = {"mb": args.mb, "steps": args.steps, "step_sleep": args.step_sleep, "every": None, "tier0": "off",
            "memory": "", "stop_at_first_step": False, **over}  # fmt: skip
    argv = [sys.executable, __file__, "--child"]
    for key, value in opts.items():
        if value is None or value is False:
            continue
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    started = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :]), started


def du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # retention removed it meanwhile
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


class Sampler:
    """The bytes under ``path``, every 20 ms, on a thread: the peak."""

    def __init__(self, path: str) -> None:
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, du(self.path))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def evict(path: str) -> None:
    """Drop ``path``'s files from the page cache (clean pages only: they were fsynced)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def median_ci(values: list[float], level: float = 0.9) -> str:
    """A distribution-free confidence interval for the median: order statistics (binomial)."""
    xs, n = sorted(values), len(values)
    k = 0  # the largest k whose [x_k, x_(n-k+1)] (1-based) still covers the median with >= level
    for j in range(n // 2):
        if 1 - 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2**n >= level:
            k = j + 1
    if k == 0:
        return f"[{xs[0]:.3f}, {xs[-1]:.3f}] (n={n}: < {level:.0%})"
    cover = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
    return f"[{xs[k - 1]:.3f}, {xs[n - k]:.3f}] ({cover:.0%})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dirpath", default="", help=argparse.SUPPRESS)
    p.add_argument("--memory", default="", help=argparse.SUPPRESS)
    p.add_argument("--stop-at-first-step", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mb", type=int, default=32, help="MB of parameters (Adam: 3x that in the state)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds of 'compute' per step")
    p.add_argument("--tier0", default="auto", help="tier0_every_n_steps for the overhead fits: auto or K")
    p.add_argument("--every", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, default=2, help="fits with and without tier 0, alternated")
    p.add_argument("--restarts", type=int, default=3, help="restarts of each kind, alternated")
    p.add_argument("--disk", default=tempfile.gettempdir())
    args = p.parse_args()
    if args.child:
        child(args)
        return
    tag = uuid.uuid4().hex[:8]
    disk = Path(args.disk) / f"lp-bench-tier0-{tag}"
    memory = f"/dev/shm/lp-bench-tier0-{tag}"
    try:
        report(args, disk, memory)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)


def report(args: argparse.Namespace, disk: Path, memory: str) -> None:
    load0 = os.getloadavg()[0]
    plain: list[dict[str, Any]] = []
    tiered: list[dict[str, Any]] = []
    peak = 0
    for i in range(args.pairs):  # side by side, ABBA: the load drifts, both kinds see it alike
        for kind in ("plain", "tier0") if i % 2 == 0 else ("tier0", "plain"):
            if kind == "plain":
                plain.append(run_child(args, dirpath=disk / f"plain{i}")[0])
                continue
            shutil.rmtree(memory, ignore_errors=True)
            with Sampler(memory) as sampler:
                tiered.append(run_child(args, dirpath=disk / f"tier0-{i}", tier0=args.tier0, memory=memory)[0])
            peak = max(peak, sampler.peak)
    end_use = du(memory)
    ratios = [t["step_s"] / b["step_s"] for b, t in zip(plain, tiered, strict=True)]
    cpu_ratios = [t["cpu_s"] / b["cpu_s"] for b, t in zip(plain, tiered, strict=True)]  # the same timed steps
    # One copy's bytes: the newest committed copy.
    copies = sorted(d for d in os.listdir(memory) if (Path(memory) / d / "manifest.json").exists())
    one_copy = du(os.path.join(memory, copies[-1])) if copies else 0

    # Restarts: the same state at the same step S, once on the disk tier, once in tier 0.
    s = WARMUP + 5
    shutil.rmtree(memory, ignore_errors=True)
    run_child(args, dirpath=disk / "r-disk", steps=s, every=s)
    run_child(args, dirpath=disk / "r-mem", steps=s, tier0=str(s), memory=memory)
    kinds = {"disk, warm page cache": disk / "r-disk", "disk, evicted from the page cache": disk / "r-disk",
             "tier 0 (/dev/shm)": disk / "r-mem"}  # fmt: skip
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    resumed: dict[str, str] = {}
    for _ in range(args.restarts):
        for kind, dirpath in kinds.items():
            if "evicted" in kind:
                evict(str(dirpath))
            tier0 = {"tier0": str(10**6), "memory": memory} if "tier 0" in kind else {}
            got, started = run_child(args, dirpath=dirpath, steps=s + 1, stop_at_first_step=True, **tier0)
            times[kind].append((got["first_step_t"] - started, got["first_step_t"] - got["fit_t"], got["resume_cpu"]))
            resumed[kind] = str(got["resumed_from"])
    med = {k: tuple(statistics.median(x) for x in zip(*v, strict=True)) for k, v in times.items()}
    warm = med["disk, warm page cache"]
    load1 = os.getloadavg()[0]

    k_used = ", ".join(str(t["k"]) for t in tiered)
    k_med = statistics.median([t["k"] for t in tiered if t["k"]] or [0])
    step_plain = statistics.median(b["step_s"] for b in plain)
    stage = statistics.median([t["stage_s"] for t in tiered if t["stage_s"] is not None] or [0.0])  # none: no copy timed
    vote = statistics.median(t["vote_s"] for t in tiered)
    blocked = [t["blocked_s"] / t["window_s"] for t in tiered]
    rows = [
        [f"step time (wall), tier 0 `{args.tier0}` (K chosen: {k_used}; {', '.join(str(t['copies']) for t in tiered)} "
         f"copies of {statistics.median(t['copy_s'] or 0 for t in tiered):.3f} s) / none: median of {len(ratios)} "
         "ABBA pairs [~90 % CI]",
         f"{statistics.median(t['step_s'] for t in tiered):.4f} / {step_plain:.4f} s",
         f"{statistics.median(ratios):.3f} {median_ci(ratios)}", "<= 1.01"],
        ["training thread blocked in tier 0's calls (copy staging + votes) / the timed steps' wall time: median "
         f"[~90 % CI] of {len(blocked)} fits", f"{statistics.median(t['blocked_s'] for t in tiered):.3f} / "
         f"{statistics.median(t['window_s'] for t in tiered):.1f} s", f"{1 + statistics.median(blocked):.4f} "
         f"{median_ci([1 + b for b in blocked])}", "<= 1.01"],
        [f"the same at the chosen K, per copy: (staging {stage:.3f} s + K x vote {vote * 1e3:.2f} ms) / "
         f"(K = {k_med:g} x step {step_plain:.4f} s)", f"{stage + k_med * vote:.3f} / {k_med * step_plain:.2f} s",
         f"{1 + (stage + k_med * vote) / (k_med * step_plain):.4f}" if k_med else "-", "<= 1.01"],
        ["process CPU time of the timed steps (all threads: training, writer, seal), tier 0 / none: median "
         f"[~90 % CI] of {len(cpu_ratios)} pairs", f"{statistics.median(t['cpu_s'] for t in tiered):.2f} / "
         f"{statistics.median(b['cpu_s'] for b in plain):.2f} s", f"{statistics.median(cpu_ratios):.3f} "
         f"{median_ci(cpu_ratios)}", "-"],
    ]
    for kind in kinds:
        if kind == "disk, warm page cache":
            continue
        total, resume, _ = med[kind]
        rows.append([f"restart: process start to first step, {kind} / disk warm", f"{total:.2f} / {warm[0]:.2f} s",
                     f"{total / warm[0]:.2f}", "<= 0.5"])  # fmt: skip
        rows.append([f"restart: `fit` to first step (the resume), {kind} / disk warm", f"{resume:.3f} / {warm[1]:.3f} s",
                     f"{resume / warm[1]:.2f}", "<= 0.5"])  # fmt: skip
    cold = med["disk, evicted from the page cache"]
    mem = med["tier 0 (/dev/shm)"]
    rows.append(["restart: `fit` to first step, tier 0 / disk cold", f"{mem[1]:.3f} / {cold[1]:.3f} s",
                 f"{mem[1] / cold[1]:.2f}", "<= 0.5"])  # fmt: skip
    for kind, other in (("cold", cold), ("warm", warm)):  # CPU: robust to load, blind to the cold disk's I/O wait
        rows.append([f"restart: the resume's process CPU time (`fit` to first step), tier 0 / disk {kind}",
                     f"{mem[2]:.3f} / {other[2]:.3f} s", f"{mem[2] / other[2]:.2f}", "<= 0.5"])  # fmt: skip
    budget = 2 * one_copy
    rows.append([f"tmpfs use, peak / budget (own copy + one peer's = 2 x {one_copy / 2**20:.0f} MiB)",
                 f"{peak / 2**20:.0f} / {budget / 2**20:.0f} MiB", f"{peak / budget:.2f}" if budget else "-", "<= 1"])
    rows.append(["tmpfs use, at the end (the newest kept) / budget", f"{end_use / 2**20:.0f} / {budget / 2**20:.0f} MiB",
                 f"{end_use / budget:.2f}" if budget else "-", "<= 1"])  # fmt: skip
    rss_t = statistics.median(t["rss_mb"] for t in tiered)
    rss_p = statistics.median(b["rss_mb"] for b in plain)
    rows.append(["peak RSS, tier-0 fit / fit without tier 0 (tmpfs pages are not in RSS)",
                 f"{rss_t:.0f} / {rss_p:.0f} MiB", f"{rss_t / rss_p:.2f}", "-"])  # fmt: skip
    print(f"model {args.mb} MB of parameters (+ Adam), {args.steps} steps of >= {args.step_sleep} s, "
          f"{args.pairs} pairs, {args.restarts} restarts of each kind; load {load0:.1f} at the start, {load1:.1f} at the end")
    print(f"resumed from: {json.dumps(resumed)}\n")
    print(table(["", "measured", "ratio", "target"], rows))
    print("\n" + machine_notes())


if __name__ == "__main__":
    main()
