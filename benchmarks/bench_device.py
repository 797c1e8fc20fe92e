"""The save of a state that lives on an accelerator (issue 25's GPU table).

One run, interleaved round by round (round 0 is the warm-up), on ``--device`` (``cuda``, or
``cpu`` for the dry run that proves the code paths):

* FLOOR: one big device-to-host copy of the state's bytes into pinned memory (plain memory
  on CPU): the most a snapshot's staging can reach;
* ours: ``ShardedAsyncCheckpointIO`` blocking time and staging GB/s (bytes / blocking), with
  no budget and with ``host_memory_budget`` = half the state (chunked through pinned memory);
* DCP: ``async_save`` with ``DefaultStager`` (pinned, async staging, non-blocking copies on
  CUDA): when it returned, and when staging completed (the state may change only then);
* training-step time of an MLP with AdamW (forward, backward, optimizer step): two steps,
  and two steps with a save after the first, synchronous and (where the plugin has
  ``overlap_staging``) overlapped; the extra time of the pair is the save's cost to training.

    python benchmarks/bench_device.py                 # cuda, 4096 MiB
    python benchmarks/bench_device.py --quick         # cpu, 16 MiB, 1 round: the dry run (scripts/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (
    MiB,
    empty_dir,
    interleaved,
    lightning_style_checkpoint,
    machine_notes,
    median,
    nbytes,
    ratio_table,
    table,
    tensors_of,
)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def floor_d2h(total: int, device: torch.device, repeats: int) -> float:
    """Seconds for one copy of ``total`` bytes from ``device`` into pinned host memory (median)."""
    cuda = device.type == "cuda"
    src = torch.ones(total, dtype=torch.uint8, device=device)
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    dst.zero_()
    times = []
    for rnd in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        _sync(device)
        if rnd:
            times.append(time.perf_counter() - t0)
    del src, dst
    return median(times)


class DeviceBench:
    """The state on ``device`` and one runner per contender (each returns its timings)."""

    def __init__(self, device: torch.device, size_mib: int, n_tensors: int, root: str) -> None:
        from lightning_preempt import ShardedAsyncCheckpointIO

        self.device = device
        self.root = root
        self.ckpt = _to(lightning_style_checkpoint(size_mib * MiB, n_tensors), device)
        self.total = nbytes(self.ckpt)
        self.tensors = tensors_of(self.ckpt)
        self.ours = ShardedAsyncCheckpointIO()
        self.budgeted = ShardedAsyncCheckpointIO(host_memory_budget=max(1 << 20, self.total // 2))
        self.dcp_stager: Any = None
        self.counter = 0

    def fresh(self, name: str) -> str:
        self.counter += 1
        return os.path.join(self.root, f"{name}-{self.counter:04d}")

    def touch(self) -> None:
        with torch.no_grad():
            for t in self.tensors:
                t.view(-1)[0] += 1.0
        self.ckpt["global_step"] += 1
        _sync(self.device)

    def save_ours(self, io: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        io.save_checkpoint(self.ckpt, self.fresh("ours"))
        t1 = time.perf_counter()
        io.wait()
        return {"blocks": t1 - t0, "committed": time.perf_counter() - t0, "peak": io.saver.stager.peak_bytes}

    def save_dcp(self) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = self.device.type == "cuda"
        if self.dcp_stager is None:
            # (no accelerator: non-blocking copies must be off, as bench_save.py's CPU run)
            self.dcp_stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                           use_async_staging=True, use_non_blocking_copy=cuda))  # fmt: skip
        t0 = time.perf_counter()
        response: Any = dcp.async_save(self.ckpt, checkpoint_id=self.fresh("dcp"), async_stager=self.dcp_stager,
                                       no_dist=True)  # fmt: skip
        returned = time.perf_counter() - t0
        response.staging_completion.result()
        staged = time.perf_counter() - t0
        response.upload_completion.result()
        return {"returned": returned, "blocks": staged, "committed": time.perf_counter() - t0}

    def close(self) -> None:
        self.ours.teardown()
        self.budgeted.teardown()
        if self.dcp_stager is not None:
            self.dcp_stager.close()


def step_costs(device: torch.device, root: str, width: int, layers: int, batch: int, repeats: int,
               overlap: bool) -> dict[str, float]:  # fmt: skip
    """Median seconds of two training steps, and of two steps with a save between them."""
    from lightning_preempt import ShardedAsyncCheckpointIO, Tuning

    torch.manual_seed(0)
    parts: list[torch.nn.Module] = []
    for _ in range(layers):
        parts += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*parts).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)
    io = ShardedAsyncCheckpointIO(tuning=Tuning(overlap_staging=True)) if overlap else ShardedAsyncCheckpointIO()
    if overlap:  # what the Trainer front-end declares (lightning/overlap_hooks.py)
        io.saver.overlap.stable = lambda: [*model.parameters(),
                                           *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]  # fmt: skip

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    def ckpt(k: int) -> dict[str, Any]:
        return {"global_step": k, "epoch": 0, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}

    def pair(save: bool, k: int) -> tuple[float, float]:
        _sync(device)
        t0 = time.perf_counter()
        step()
        blocked = 0.0
        if save:
            s0 = time.perf_counter()
            io.save_checkpoint(ckpt(k), os.path.join(root, f"steps-{k:04d}"))
            blocked = time.perf_counter() - s0
        step()
        _sync(device)
        took = time.perf_counter() - t0
        io.wait()  # the write finishes outside the timing
        shutil.rmtree(os.path.join(root, f"steps-{k:04d}"), ignore_errors=True)
        return took, blocked

    for k in range(2):  # warm-up: kernels, optimizer state, staging buffers
        pair(True, k)
    plain, saved, blocked = [], [], []
    for k in range(2, 2 + repeats):
        plain.append(pair(False, k)[0])
        took, b = pair(True, 1000 + k)
        saved.append(took)
        blocked.append(b)
    io.teardown()
    state = sum(t.numel() * t.element_size() for t in ckpt(0)["state_dict"].values())
    return {"two_steps": median(plain), "with_save": median(saved), "save_blocked": median(blocked),
            "state_bytes": 3 * state}  # fmt: skip


def run_device(args: argparse.Namespace) -> str:
    """The device section's markdown (see the module docstring)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch has no CUDA (torch.cuda.is_available() is False)")
    root = args.dir or tempfile.mkdtemp(prefix="lp-bench-device-", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    started = time.perf_counter()
    bench = DeviceBench(device, args.size_mib, args.tensors, root)
    total = bench.total
    floor_s = floor_d2h(total, device, args.repeats)
    runners = {"ours": lambda: bench.save_ours(bench.ours), "ours_half": lambda: bench.save_ours(bench.budgeted),
               "dcp": bench.save_dcp}  # fmt: skip
    try:
        results = interleaved(runners, args.repeats, before=lambda _: bench.touch(), between=lambda: empty_dir(root))
    finally:
        bench.close()
    width, layers, batch = (4096, 8, 8192) if device.type == "cuda" else (256, 4, 64)
    overlap_ok = "overlap_staging" in inspect.signature(type(bench.ours).__init__).parameters
    sync_steps = step_costs(device, root, width, layers, batch, args.repeats, overlap=False)
    over_steps = step_costs(device, root, width, layers, batch, args.repeats, overlap=True) if overlap_ok else None
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    def med(m: str, key: str) -> float:
        return median([r[key] for r in results[m]])

    gbps = lambda s: f"{total / s / 1e9:.2f}"  # noqa: E731
    rows = [
        ["FLOOR: one copy into pinned host memory" if device.type == "cuda" else "FLOOR: one host copy",
         f"{floor_s:.3f}", gbps(floor_s), "—", "—"],
        ["ShardedAsyncCheckpointIO", f"{med('ours', 'blocks'):.3f}", gbps(med("ours", "blocks")),
         f"{med('ours', 'committed'):.3f}", f"stager peak {med('ours', 'peak') / MiB:.0f} MiB"],
        ["  host_memory_budget = half the state", f"{med('ours_half', 'blocks'):.3f}", gbps(med("ours_half", "blocks")),
         f"{med('ours_half', 'committed'):.3f}", f"stager peak {med('ours_half', 'peak') / MiB:.0f} MiB"],
        ["DCP async_save, DefaultStager", f"{med('dcp', 'blocks'):.3f}", gbps(med("dcp", "blocks")),
         f"{med('dcp', 'committed'):.3f}", f"async_save returned after {med('dcp', 'returned'):.3f}s"],
    ]  # fmt: skip
    step_rows = [["two training steps", f"{sync_steps['two_steps']:.4f}", "—", "—"]]
    extra_sync = sync_steps["with_save"] - sync_steps["two_steps"]
    step_rows.append(["  with a save between them (synchronous staging)", f"{sync_steps['with_save']:.4f}",
                      f"{extra_sync:+.4f}", f"{sync_steps['save_blocked']:.4f}"])  # fmt: skip
    checks = [("ours staging GB/s / pinned D2H floor", floor_s / med("ours", "blocks"), 0.8, True)]
    notes = []
    if over_steps is not None:
        extra_over = over_steps["with_save"] - over_steps["two_steps"]
        step_rows.append(["  with a save between them (overlapped staging)", f"{over_steps['with_save']:.4f}",
                          f"{extra_over:+.4f}", f"{over_steps['save_blocked']:.4f}"])  # fmt: skip
        checks.append(("overlapped save's step-time increase / synchronous copy time",
                       max(extra_over, 0.0) / max(sync_steps["save_blocked"], 1e-9), 0.25, False))  # fmt: skip
    else:
        notes.append("- overlapped staging: this build has no overlap_staging option; not measured")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: no accelerator)"
    return "\n".join([
        f"### bench_device --device {device.type}: {total / MiB:.0f} MiB in {len(bench.tensors)} float32 tensors on "
        f"{name}, {args.repeats} measured rounds after 1 warm-up (median)",
        "",
        f"Machine: {machine_notes()}; run took {time.perf_counter() - started:.0f}s",
        "",
        table(["method", "blocks (s)", "staging GB/s", "committed (s)", "notes"], rows),
        "",
        f"Training step: MLP {layers}x{width}, batch {batch}, AdamW "
        f"({sync_steps['state_bytes'] / MiB:.0f} MiB of parameters and optimizer state), median of {args.repeats}:",
        "",
        table(["steps", "time (s)", "extra (s)", "save blocked (s)"], step_rows),
        "",
        *ratio_table(checks, title=""),
        *notes,
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu: the dry run of the code paths")
    p.add_argument("--size-mib", type=int, default=4096, help="state size in MiB (default 4096)")
    p.add_argument("--tensors", type=int, default=24, help="number of tensors (default 24)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds after the warm-up (default 3)")
    p.add_argument("--dir", default=None, help="where to write (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--quick", action="store_true", help="dry run: cpu, 16 MiB, 8 tensors, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.size_mib, args.tensors, args.repeats = "cpu", 16, 8, 1
    print(run_device(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
