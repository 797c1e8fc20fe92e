"""Steady-state save cost: how long ``save_checkpoint`` blocks and how long until durable.

Compares ``ShardedAsyncCheckpointIO`` with Lightning's ``TorchCheckpointIO`` (plus fsync),
Lightning's ``AsyncCheckpointIO`` (plus fsync), DCP ``async_save`` with a CPU stager, and
two floors: a copy into preallocated buffers (the least a snapshot can block) and a plain
sequential write + fsync of the same bytes (the least a durable save can take).

Methods are interleaved round by round (round 0 is the warm-up and is not reported); the
ratios are medians of per-round ratios, so they compare numbers taken seconds apart.

    python benchmarks/bench_save.py            # ~1 GiB, ~3 min
    python benchmarks/bench_save.py --quick    # 128 MiB smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    MiB,
    fmt_range,
    fmt_s,
    fsync_path,
    lightning_style_checkpoint,
    machine_notes,
    median,
    nbytes,
    table,
    tensors_of,
    verdict,
)

Result = tuple[float, float | None, dict[str, float]]  # blocking_s, committed_s, extras


class Bench:
    """Holds the state and one runner per method; every runner returns a :data:`Result`."""

    def __init__(self, root: str, checkpoint: dict[str, Any], thread_count: int | None) -> None:
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

        from lightning_preempt import ShardedAsyncCheckpointIO

        class FsyncTorchCheckpointIO(TorchCheckpointIO):
            """Lightning's torch.save plugin plus an fsync of the file and its directory."""

            def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
                super().save_checkpoint(checkpoint, path, storage_options)
                fsync_path(str(path))
                fsync_path(os.path.dirname(str(path)))

        self.root = root
        self.ckpt = checkpoint
        self.tensors = tensors_of(checkpoint)
        self.floor_buffers = [torch.empty_like(t) for t in self.tensors]
        self.ours = ShardedAsyncCheckpointIO() if thread_count is None else ShardedAsyncCheckpointIO(thread_count=thread_count)
        self.torch_io = FsyncTorchCheckpointIO()
        self.async_io = AsyncCheckpointIO(FsyncTorchCheckpointIO())
        self.dcp_stager: Any = None
        self.staging_bytes: list[int] = []
        self.counter = 0

    def fresh(self, name: str) -> str:
        self.counter += 1
        return os.path.join(self.root, f"{name}-{self.counter:04d}")

    def touch(self) -> None:
        """A cheap 'training step': change one element of every tensor."""
        for t in self.tensors:
            t.view(-1)[0] += 1.0
        self.ckpt["global_step"] += 1

    # ---- floors ----------------------------------------------------------------------
    def floor_copy(self) -> Result:
        t0 = time.perf_counter()
        for buf, t in zip(self.floor_buffers, self.tensors, strict=True):
            buf.copy_(t)
        return time.perf_counter() - t0, None, {}

    def floor_write(self) -> Result:
        path = self.fresh("floor-write")
        os.makedirs(path)
        t0 = time.perf_counter()
        fd = os.open(os.path.join(path, "data.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in self.tensors:
                view = t.numpy().data.cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(path)
        dt = time.perf_counter() - t0
        return dt, dt, {}

    # ---- contenders --------------------------------------------------------------------
    def ours_save(self) -> Result:
        path = self.fresh("ours")
        t0 = time.perf_counter()
        self.ours.save_checkpoint(self.ckpt, path)
        t1 = time.perf_counter()
        self.ours.wait()
        t2 = time.perf_counter()
        self.staging_bytes.append(self.ours.staging_allocated_bytes)
        return t1 - t0, t2 - t0, {}

    def torch_sync(self) -> Result:
        path = os.path.join(self.fresh("torch"), "last.ckpt")
        t0 = time.perf_counter()
        self.torch_io.save_checkpoint(self.ckpt, path)
        dt = time.perf_counter() - t0
        return dt, dt, {}

    def lightning_async(self) -> Result:
        path = os.path.join(self.fresh("pl-async"), "last.ckpt")
        t0 = time.perf_counter()
        self.async_io.save_checkpoint(self.ckpt, path)
        t1 = time.perf_counter()
        self.async_io.teardown()  # joins the executor: the save (incl. fsync) is done
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, {}

    def dcp_async(self) -> Result:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self.dcp_stager is None:
            # No accelerator: non-blocking copies must be off (see shared/FINDINGS.md).
            self.dcp_stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=False,
                )
            )
        path = self.fresh("dcp")
        t0 = time.perf_counter()
        response: Any = dcp.async_save(self.ckpt, checkpoint_id=path, async_stager=self.dcp_stager, no_dist=True)
        t_ret = time.perf_counter()
        response.staging_completion.result()  # tensors may not change before this
        t1 = time.perf_counter()
        response.upload_completion.result()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, {"returned_s": t_ret - t0}

    def close(self) -> None:
        self.ours.teardown()
        self.async_io.teardown()
        if self.dcp_stager is not None:
            self.dcp_stager.close()


METHODS: dict[str, tuple[str, str]] = {
    # key: (label, note)
    "floor_copy": ("FLOOR: copy into preallocated buffers", "blocking floor; no I/O"),
    "floor_write": ("FLOOR: sequential write + fsync", "commit floor; one file, same bytes"),
    "ours": ("ShardedAsyncCheckpointIO", "committed = manifest durable (`.wait()`)"),
    "torch_sync": ("Lightning TorchCheckpointIO", "sync torch.save; + fsync file & dir (added for fairness)"),
    "lightning_async": ("Lightning AsyncCheckpointIO", "wraps TorchCheckpointIO + fsync; clones tensors"),
    "dcp_async": ("DCP async_save, CPU DefaultStager", "blocks = returned + staging done; sync_files=True"),
}


def run(args: argparse.Namespace) -> str:
    root = args.dir or tempfile.mkdtemp(prefix="lp-bench-save-", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    ckpt = lightning_style_checkpoint(args.size_mib * MiB, args.tensors)
    total = nbytes(ckpt)
    bench = Bench(root, ckpt, args.ours_threads)
    runners: dict[str, Callable[[], Result]] = {
        "floor_copy": bench.floor_copy,
        "floor_write": bench.floor_write,
        "ours": bench.ours_save,
        "torch_sync": bench.torch_sync,
        "lightning_async": bench.lightning_async,
        "dcp_async": bench.dcp_async,
    }
    methods = [m for m in runners if not args.methods or m in args.methods.split(",")]
    results: dict[str, list[Result]] = {m: [] for m in methods}
    started = time.perf_counter()
    try:
        for rnd in range(args.repeats + 1):
            order = methods[rnd % len(methods) :] + methods[: rnd % len(methods)]  # rotate: no fixed neighbour
            for m in order:
                bench.touch()
                r = runners[m]()
                if rnd > 0:
                    results[m].append(r)
                if args.verbose:
                    print(f"round {rnd} {m}: blocks {r[0]:.3f}s committed {fmt_s(r[1])}s {r[2]}", file=sys.stderr)
                for entry in os.listdir(root):  # keep the disk tidy; outside the timings
                    shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    finally:
        bench.close()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started

    rows = []
    for m in methods:
        label, note = METHODS[m]
        blocks = [r[0] for r in results[m]]
        commits = [r[1] for r in results[m] if r[1] is not None]
        extra = ""
        if m == "dcp_async":
            extra = f"; async_save returned after {median([r[2]['returned_s'] for r in results[m]]):.3f}s"
        gbps = f"{total / median(commits) / 1e9:.2f}" if commits else "—"
        rows.append(
            [
                label,
                fmt_s(median(blocks)),
                fmt_range(blocks),
                fmt_s(median(commits)) if commits else "—",
                fmt_range(commits),
                gbps,
                note + extra,
            ]
        )
    out = [
        f"### bench_save: {total / MiB:.0f} MiB in {len(bench.tensors)} float32 tensors, "
        f"{args.repeats} measured rounds after 1 warm-up (median, min-max)",
        "",
        f"Machine: {machine_notes()}; target dir: {args.dir or '/tmp (fresh dir)'}; run took {elapsed:.0f}s",
        "",
        table(
            ["method", "blocks (s)", "range", "committed (s)", "range", "GB/s to durable", "notes"],
            rows,
        ),
        "",
    ]
    if "ours" in methods:
        sb = bench.staging_bytes
        grew = len(set(sb)) > 1
        out.append(
            f"Staging memory allocated by ShardedAsyncCheckpointIO after each measured save: "
            f"{', '.join(f'{b / MiB:.0f} MiB' for b in sb)} "
            f"({'GREW after the first save' if grew else 'constant after the first save'}; state is {total / MiB:.0f} MiB)"
        )
        out.append("")

    def paired(a: str, b: str, ia: int, ib: int) -> float:
        ratios = []
        for ra, rb in zip(results[a], results[b], strict=True):
            va = ra[0] if ia == 0 else ra[1]
            vb = rb[0] if ib == 0 else rb[1]
            if va is not None and vb is not None:
                ratios.append(va / vb)
        return median(ratios)

    ratio_rows, verdicts = [], []
    specs = [
        ("ours blocking / floor copy", "ours", "floor_copy", 0, 0, 1.3, False),
        ("sync torch.save blocking / ours blocking", "torch_sync", "ours", 0, 0, 5.0, True),
        ("ours committed / (sequential write + fsync)", "ours", "floor_write", 1, 1, 1.5, False),
    ]
    for name, a, b, ia, ib, target, higher in specs:
        if a in methods and b in methods:
            row, line = verdict(name, paired(a, b, ia, ib), target, higher)
            ratio_rows.append(row)
            verdicts.append(line)
    if ratio_rows:
        out += ["Ratios (median of per-round ratios, same run):", ""]
        out += [table(["ratio", "value", "target", "verdict"], ratio_rows), "", *verdicts]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--tensors", type=int, default=24, help="number of tensors (default 24)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds after the warm-up (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 16 tensors")
    p.add_argument("--methods", default="", help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--ours-threads", type=int, default=None, help="thread_count for ours (default: the plugin's)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every round to stderr")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.tensors = 128, 16
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
