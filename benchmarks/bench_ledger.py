"""What the goodput ledger and the metrics in the user's logger cost a training step.

One process, one Lightning ``Trainer`` per fit, a CSVLogger always attached; three
variants interleaved round by round (same run, same machine state):

* ``ledger + metrics``: the defaults (the ledger's writer thread, figures logged at saves);
* ``ledger, no metrics``: ``log_metrics=False``;
* ``neither``: ``ledger=False, log_metrics=False`` (the floor for both).

A step's time is from one ``on_train_batch_start`` to the next, so it includes every end
hook of the step: the save (every ``--every`` steps), the ledger's records, the logging of
the figures (at the step after a save committed). Wall time, and the training thread's CPU
time (``time.thread_time``: what the step itself spent, much less disturbed by other
processes on a shared machine). Medians per round; the ratios are medians of per-round ratios.

    python benchmarks/bench_ledger.py            # ~2 min on 2 CPU cores
    python benchmarks/bench_ledger.py --quick
"""

from __future__ import annotations

import argparse
import itertools
import logging
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import MiB, machine_notes, median, table, verdict

KINDS = ("save", "after save", "plain", "save cpu", "after save cpu", "plain cpu")
#: Seconds the training thread spent in the ledger's and the reporter's calls (the direct cost).
ON_THREAD: dict[str, list[float]] = {"ledger (records queued)": [], "metrics (figures + log_metrics)": []}

VARIANTS = {
    "ledger + metrics": {},
    "ledger, no metrics": {"log_metrics": False},
    "neither": {"ledger": False, "log_metrics": False},
}


def fit_once(root: Path, kwargs: dict[str, Any], args: argparse.Namespace) -> dict[str, list[float]]:
    """One fit; the times of steps with a save, of the step after it, and of the other steps."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    width = int((args.size_mib * MiB / 4 / 3) ** 0.5)  # weights + Adam's two moments

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(width, width)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.log("loss_like", float(batch_idx))  # the user's own metric, as a real run logs one
            return self.net(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    starts: list[tuple[float, float]] = []

    class Clock(Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            starts.append((time.perf_counter(), time.thread_time()))

    data = torch.utils.data.DataLoader(torch.randn(args.steps * 4, width), batch_size=4)
    callback = PreemptionCallback(str(root / "ck"), every_n_train_steps=args.every, keep_last_n=2, lease=False, **kwargs)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", callbacks=[callback, Clock()],
                        plugins=[ShardedAsyncCheckpointIO()], logger=CSVLogger(str(root / "logs")),
                        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Model(), data)
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(starts)]  # [i]: step i + 1 + end hooks
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for i, (wall, cpu) in enumerate(steps[args.every :], start=args.every + 1):  # past the first save (warm-up)
        kind = "save" if i % args.every == 0 else "after save" if i % args.every == 1 else "plain"
        out[kind].append(wall)
        out[f"{kind} cpu"].append(cpu)
    return out


def _timed(owner: Any, name: str, into: list[float]) -> None:
    """Time ``owner.name`` when the training (main) thread calls it."""
    original: Callable[..., Any] = getattr(owner, name)

    def timed(*a: Any, **k: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return original(*a, **k)
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            into.append(time.perf_counter() - t)

    setattr(owner, name, timed)


def run(args: argparse.Namespace) -> str:
    from lightning_preempt.engine.ledger_writer import Ledger
    from lightning_preempt.lightning.logs import SaveReporter

    for method in ("add", "progress"):
        _timed(Ledger, method, ON_THREAD["ledger (records queued)"])
    _timed(SaveReporter, "report", ON_THREAD["metrics (figures + log_metrics)"])
    logging.getLogger("lightning_preempt").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    per_round: dict[str, dict[str, list[float]]] = {v: {k: [] for k in KINDS} for v in VARIANTS}
    started = time.perf_counter()
    for _ in range(args.rounds):
        for name, kwargs in VARIANTS.items():
            root = Path(tempfile.mkdtemp(prefix="lp-bench-ledger-"))
            try:
                times = fit_once(root, kwargs, args)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            for kind, values in times.items():
                per_round[name][kind].append(median(values))
    elapsed = time.perf_counter() - started
    plain = median([median(per_round[v]["plain cpu"]) for v in VARIANTS])
    direct = [[name, str(len(ts)), f"{median(ts) * 1e3:.3f}", f"{sorted(ts)[int(len(ts) * 0.99)] * 1e3:.3f}",
               f"{max(ts) * 1e3:.3f}", f"{median(ts) / plain:.2%}"] for name, ts in ON_THREAD.items() if ts]  # fmt: skip
    rows = [[name, *(f"{median(per_round[name][k]) * 1e3:.1f}" for k in KINDS)] for name in VARIANTS]

    def ratio(a: str, b: str, kind: str) -> float:
        return median([x / y for x, y in zip(per_round[a][kind], per_round[b][kind])])

    on, off, floor = VARIANTS
    checks = [
        verdict(f"step with a save, {clock}: metrics on / off", ratio(on, off, f"save{sfx}"), 1.05, False)
        for clock, sfx in (("CPU", " cpu"), ("wall", ""))
    ] + [
        verdict(f"step after a save (logs the figures), {clock}: metrics on / off", ratio(on, off, f"after save{sfx}"),
                1.05, False) for clock, sfx in (("CPU", " cpu"), ("wall", ""))
    ] + [
        verdict("step with a save, CPU: ledger on / off", ratio(off, floor, "save cpu"), 1.05, False),
        verdict("plain step, CPU: ledger + metrics / neither", ratio(on, floor, "plain cpu"), 1.05, False),
    ]  # fmt: skip
    return "\n".join([
        f"### bench_ledger (run took {elapsed:.0f}s)", "", f"Machine: {machine_notes()}", "",
        f"{args.size_mib} MiB of weights + Adam state, a save every {args.every} steps, {args.steps} steps per fit, "
        f"{args.rounds} interleaved rounds; medians of per-round medians (ms per step, end hooks included):", "",
        table(["variant", "save (wall)", "after it (wall)", "other (wall)", "save (CPU)", "after it (CPU)",
               "other (CPU)"], rows), "",
        table(["ratio (median of per-round ratios)", "value", "target", "verdict"], [r for r, _ in checks]), "",
        "Direct cost on the training thread (every call, all variants that make it):", "",
        table(["calls", "n", "median ms", "p99 ms", "max ms", "median / plain step (CPU)"], direct), "",
        *[line for _, line in checks],
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--steps", type=int, default=61)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smoke run: 16 MiB, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.rounds, args.steps = 16, 2, 31
    torch.set_num_threads(1)
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
