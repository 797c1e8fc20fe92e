"""Step time with a save in the step: overlapped staging against synchronous staging and
against no save at all, same run (issue 25, item 4). ``bench_save.py`` prints this section
after its table; it also runs alone.

A small MLP trains with AdamW (forward + backward + optimizer step). A measured *pair* is
the save taken at the end of step k plus the whole of step k+1, which is what overlapped
staging changes: the save returns sooner, and step k+1's forward and backward run while
the parameters and optimizer state are copied (its optimizer step waits for the copy).
The pair is compared with the same step without a save. The three modes are interleaved round
by round; the writer's commit is waited for between pairs, outside the timings. The writer
runs during step k+1 in both save modes alike; the "writer after the step" rows hold it
until the step is done, so that only the staging copy competes with the step. Uses the framework-neutral ``Saver`` as a
hand-written loop would (save/saver.py, staging/overlap.py).

    python benchmarks/step_time.py                 # ~190 MiB of state, ~1 min
    python benchmarks/step_time.py --width 1024 --layers 8 --batch 64
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MiB, fmt_range, machine_notes, median, table

MODES = ("no save", "synchronous staging", "overlapped staging", "synchronous, writer after the step",
         "overlapped, writer after the step")  # fmt: skip


class Run:
    """One model, optimizer and batch; a saver per save mode (each with its own buffers)."""

    def __init__(self, width: int, layers: int, batch: int, root: str) -> None:
        from lightning_preempt.save.saver import Saver

        torch.manual_seed(0)
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x, self.y = torch.randn(batch, width), torch.randn(batch, 1)
        self.root = root
        self.step_no = 0
        sync, overlapped = Saver({}, overlap_staging=False), Saver({}, overlap_staging=True)
        overlapped.overlap.stable = self.stable
        self.savers = {MODES[1]: sync, MODES[2]: overlapped, MODES[3]: sync, MODES[4]: overlapped}
        self.step()  # AdamW's state exists from here on

    def stable(self) -> Iterator[torch.Tensor]:
        yield from self.model.parameters()
        for state in self.opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stable())

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()
        self.step_no += 1

    def checkpoint(self) -> dict[str, Any]:
        return {"state_dict": self.model.state_dict(), "optimizer_states": [self.opt.state_dict()],
                "global_step": self.step_no, "epoch": 0}  # fmt: skip

    def pair(self, mode: str) -> tuple[float, float]:
        """(time the save blocked, time of save + the next step); no save: the step alone."""
        saver = self.savers.get(mode)
        self.step()
        writer = threading.Event()
        if saver is not None and "writer after" in mode:
            saver.submit(writer.wait)  # the write job queues behind it: staging alone competes with the step
        else:
            writer.set()
        t0 = time.perf_counter()
        if saver is None:
            t1 = t0
        else:
            from lightning_preempt.save.order import SaveOrder

            saver.save(self.checkpoint(), SaveOrder(os.path.join(self.root, f"s{self.step_no}")))
            t1 = time.perf_counter()
        self.step()
        t2 = time.perf_counter()
        writer.set()
        if saver is not None:
            saver.wait()  # the commit, outside the timings
            shutil.rmtree(os.path.join(self.root, f"s{self.step_no - 1}"), ignore_errors=True)
        return t1 - t0, t2 - t0

    def close(self) -> None:
        for saver in self.savers.values():
            saver.close()


def measure(width: int, layers: int, batch: int, repeats: int) -> tuple[str, dict[str, float]]:
    """The section's text and its figures (median seconds, ratios)."""
    root = tempfile.mkdtemp(prefix="lp-step-time-")
    started = time.perf_counter()
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    run = Run(width, layers, batch, root)
    try:
        for rnd in range(repeats + 1):
            for mode in MODES if rnd % 2 else tuple(reversed(MODES)):
                r = run.pair(mode)
                if rnd:  # round 0 warms up every path (buffers, plans, threads)
                    results[mode].append(r)
        state = run.state_bytes
    finally:
        run.close()
        shutil.rmtree(root, ignore_errors=True)
    base = [p for _, p in results[MODES[0]]]
    step_s = median(base)
    rows, figures = [], {"step_s": step_s}
    for mode in MODES:
        blocks, pairs = [b for b, _ in results[mode]], [p for _, p in results[mode]]
        extra = [p - b0 for p, b0 in zip(pairs, base, strict=True)]
        figures[f"{mode} pair_s"] = median(pairs)
        figures[f"{mode} added_s"] = median(extra)
        rows.append([mode, f"{median(blocks):.4f}" if mode != MODES[0] else "—", f"{median(pairs):.4f}",
                     fmt_range(pairs), f"{median(extra):+.4f}"])  # fmt: skip
    lines = []
    for over, sync, what in ((MODES[2], MODES[1], "writer during the step"), (MODES[4], MODES[3], "staging alone")):
        pair_ratio = median([po / ps for (_, po), (_, ps) in zip(results[over], results[sync], strict=True)])
        added = median([(po - b0) / max(ps - b0, 1e-9)
                        for (_, po), (_, ps), b0 in zip(results[over], results[sync], base, strict=True)])  # fmt: skip
        figures[f"overlap/sync pair, {what}"], figures[f"overlap/sync added, {what}"] = pair_ratio, added
        lines.append(f"- {what}: save + next step {pair_ratio:.2f}x, the time a save adds {added:.2f}x")
    params = sum(p.numel() for p in run.model.parameters())
    out = [
        f"### step time with a save in the step: MLP {layers}x{width} ({params / 1e6:.1f} M params, AdamW, batch "
        f"{batch}), {state / MiB:.0f} MiB of parameters + optimizer state, {repeats} rounds after 1 warm-up",
        "",
        f"Machine: {machine_notes()}; torch threads {torch.get_num_threads()}; one step without a save "
        f"{step_s:.4f}s; run took {time.perf_counter() - started:.0f}s",
        "",
        table(["mode", "save blocked (s)", "save + next step (s)", "range", "added to the step (s)"], rows),
        "",
        "Overlapped / synchronous (medians of per-round ratios; < 1: overlap gains):",
        "",
        *lines,
    ]
    return "\n".join(out), figures


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument(f"--{prefix}width", type=int, default=2048, help="MLP width (default 2048)")
    p.add_argument(f"--{prefix}layers", type=int, default=4, help="MLP hidden layers (default 4)")
    p.add_argument(f"--{prefix}batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument(f"--{prefix}repeats", type=int, default=9, help="measured rounds (default 9)")


def from_args(args: argparse.Namespace, prefix: str = "") -> Callable[[], tuple[str, dict[str, float]]]:
    get = lambda name: getattr(args, f"{prefix}{name}")  # noqa: E731
    return lambda: measure(get("width"), get("layers"), get("batch"), get("repeats"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    print(from_args(p.parse_args(argv))()[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
