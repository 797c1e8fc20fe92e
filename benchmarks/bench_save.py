"""Steady-state save cost: how long ``save_checkpoint`` blocks and how long until durable.

Compares ``ShardedAsyncCheckpointIO`` with Lightning's ``TorchCheckpointIO`` (plus fsync),
Lightning's ``AsyncCheckpointIO`` (plus fsync), DCP ``async_save`` with a CPU stager, and
two floors: a copy into preallocated buffers (the least a snapshot can block) and a plain
sequential write + fsync of the same bytes (the least a durable save can take).

Methods are interleaved round by round (round 0 is the warm-up and is not reported); the
ratios are medians of per-round ratios, so they compare numbers taken seconds apart.

``--tensors 24,400,4000`` measures each count (the same total bytes) and ends with the
curve: each ratio per tensor count (the cost per tensor, not per byte). ``--ranks 2,4``
adds DDP saves on that many gloo ranks (every rank saves its share, as under
``PreemptionCallback``), the slowest rank against a write + fsync of its share.

The Fabric rows (benchmarks/_fabric_save.py) time ``fabric.save`` of a Fabric loop's state
(module, optimizer, step) on the same tensors, with our plugin and with Fabric's default.

    python benchmarks/bench_save.py            # ~1 GiB, ~3 min
    python benchmarks/bench_save.py --size-mib 256 --tensors 24,400,4000 --ranks 2,4  # the curve
    python benchmarks/bench_save.py --quick    # 128 MiB smoke run
    python benchmarks/bench_save.py --host-budget   # peak RSS under host_memory_budget (bench_host_budget.py)
    python benchmarks/bench_save.py --device cuda --size-mib 4096  # the GPU table (bench_device.py)

On the CPU a second section follows, "step time with a save in the step"
(benchmarks/step_time.py): overlapped staging against synchronous staging and no save, for
a small MLP trained with AdamW (``--step-width``/``--step-layers``/``--step-batch``/
``--step-repeats``; ``--no-step-time`` skips it).
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
import step_time
from _common import (
    MiB,
    empty_dir,
    fmt_range,
    fmt_s,
    fsync_path,
    interleaved,
    lightning_style_checkpoint,
    machine_notes,
    median,
    nbytes,
    ratio_table,
    table,
    tensors_of,
)
from _fabric_save import METHODS as FABRIC_METHODS
from _fabric_save import FabricSaves

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
        self.ours = (
            ShardedAsyncCheckpointIO() if thread_count is None else ShardedAsyncCheckpointIO(thread_count=thread_count)
        )
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
    **FABRIC_METHODS,
}


def run(args: argparse.Namespace) -> str:
    """One report per tensor count (and rank count), then the curve when there are several."""
    counts = [int(n) for n in str(args.tensors).split(",")]
    worlds = [int(w) for w in str(args.ranks).split(",") if w.strip() and int(w) > 1]
    reports, curve = [], {}
    for n in counts:
        one = argparse.Namespace(**{**vars(args), "tensors": n})
        text, figures = run_one(one)
        for world in worlds:
            ranks_figures, line = bench_ranks(one, world)
            figures |= ranks_figures
            text += "\n\n" + line
        reports.append(text)
        curve[n] = figures
    if len(counts) > 1 or worlds:
        rows = []
        labels = (
            [*CURVE]
            + [
                (f"{w} ranks: slowest rank committed / its share's write + fsync", f"{w} ranks committed/floor_write")
                for w in worlds
            ]
            + [
                (f"{w} ranks: slowest rank blocking / copy of its share", f"{w} ranks blocking/floor_copy")
                for w in worlds
            ]
        )
        for label, key in labels:
            if any(key in curve[n] for n in counts):
                rows.append([label, *(f"{curve[n][key]:.2f}" if key in curve[n] else "—" for n in counts)])
        reports.append(
            "\n".join(
                [
                    f"### The curve: {args.size_mib} MiB in {', '.join(map(str, counts))} tensors "
                    "(median of per-round ratios; each column is one run above)",
                    "",
                    table(["ratio", *(f"{n} tensors" for n in counts)], rows),
                ]
            )
        )
    return "\n\n".join(reports)


# ---- N ranks: DDP saves, every rank its share --------------------------------------------
def _rank_worker(rank: int, init_file: str, root: str, size_mib: int, n_tensors: int, repeats: int, world: int) -> None:
    """One rank: rounds of (a) a collective save of the replicated state (the slowest rank's
    blocking and committed times count) and (b) the floors for this rank's share: a copy
    into preallocated buffers and a sequential write + fsync of the bytes it staged."""
    import json

    import torch.distributed as dist

    from lightning_preempt import ShardedAsyncCheckpointIO
    from lightning_preempt.collective.groups import new_gloo_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ckpt = lightning_style_checkpoint(size_mib * MiB, n_tensors)  # same seed on every rank: replicated
    io = ShardedAsyncCheckpointIO()
    io.enable_collective_saves(new_gloo_group())
    tensors = tensors_of(ckpt)
    times: dict[str, list[float]] = {"blocking": [], "committed": [], "floor_copy": [], "floor_write": []}
    share: list[torch.Tensor] = []
    for rnd in range(repeats + 1):
        for t in tensors:
            t.view(-1)[0] += 1.0
        ckpt["global_step"] += 1
        path = os.path.join(root, f"ours-{rnd}")
        dist.barrier()
        t0 = time.perf_counter()
        io.save_checkpoint(ckpt, path)
        t1 = time.perf_counter()
        io.wait()
        t2 = time.perf_counter()
        if not share:  # this rank's share: as many bytes as it staged, from the front
            left = io.staging_last_bytes
            for t in tensors:
                if left <= 0:
                    break
                share.append(t)
                left -= t.numel() * t.element_size()
            buffers = [torch.empty_like(t) for t in share]
        t3 = time.perf_counter()
        for buf, t in zip(buffers, share, strict=True):
            buf.copy_(t)
        t4 = time.perf_counter()
        fd = os.open(os.path.join(root, f"floor-{rank}-{rnd}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in share:
                view = t.numpy().data.cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(root)
        t5 = time.perf_counter()
        mine = [t1 - t0, t2 - t0, t4 - t3, t5 - t4]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rnd > 0:
            for i, key in enumerate(times):
                times[key].append(max(g[i] for g in gathered))  # the slowest rank's
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        os.remove(os.path.join(root, f"floor-{rank}-{rnd}"))
    if rank == 0:
        with open(os.path.join(root, "ranks.json"), "w") as f:
            json.dump(times, f)
    io.teardown()
    dist.destroy_process_group()


def bench_ranks(args: argparse.Namespace, world: int) -> tuple[dict[str, float], str]:
    """Figures of :func:`_rank_worker` on ``world`` ranks, and a line saying them."""
    import json

    import torch.multiprocessing as mp

    root = tempfile.mkdtemp(prefix=f"lp-bench-save-ranks{world}-", dir=args.dir or "/tmp")
    try:
        mp.start_processes(
            _rank_worker,
            args=(os.path.join(root, "init"), root, args.size_mib, args.tensors, args.repeats, world),
            nprocs=world,
            start_method="spawn",
        )
        with open(os.path.join(root, "ranks.json")) as f:
            times = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def ratio(a: str, b: str) -> float:
        return median([x / y for x, y in zip(times[a], times[b], strict=True)])

    figures = {
        f"{world} ranks committed/floor_write": ratio("committed", "floor_write"),
        f"{world} ranks blocking/floor_copy": ratio("blocking", "floor_copy"),
    }
    line = (
        f"DDP save, {args.tensors} tensors on {world} gloo ranks (slowest rank, median of {args.repeats}): blocks "
        f"{median(times['blocking']):.3f} s, committed {median(times['committed']):.3f} s; floors for its share: "
        f"copy {median(times['floor_copy']):.3f} s, write + fsync {median(times['floor_write']):.3f} s; "
        f"committed / write + fsync {figures[f'{world} ranks committed/floor_write']:.2f}"
    )
    return figures, line


#: The curve's rows: (label, figure key).
CURVE = [
    ("ours blocking / floor copy", "ours blocking/floor_copy"),
    ("ours committed / (sequential write + fsync)", "ours committed/floor_write"),
    ("TorchCheckpointIO committed / (write + fsync)", "torch_sync committed/floor_write"),
    ("DCP async_save committed / (write + fsync)", "dcp_async committed/floor_write"),
]


def run_one(args: argparse.Namespace) -> tuple[str, dict[str, float]]:
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
    methods = [m for m in METHODS if not args.methods or m in args.methods.split(",")]
    fabric = FabricSaves(ckpt, bench.fresh, args.ours_threads) if any(m in FABRIC_METHODS for m in methods) else None
    if fabric is not None:
        runners |= {m: fabric.runner(m) for m in FABRIC_METHODS}
    started = time.perf_counter()

    def timed(m: str) -> Callable[[], Result]:
        def once() -> Result:
            r = runners[m]()
            if args.verbose:
                print(f"{m}: blocks {r[0]:.3f}s committed {fmt_s(r[1])}s {r[2]}", file=sys.stderr)
            return r

        return once

    try:
        results = interleaved({m: timed(m) for m in methods}, args.repeats, before=lambda _: bench.touch(),
                              between=lambda: empty_dir(root))  # fmt: skip
    finally:
        bench.close()
        if fabric is not None:
            fabric.close()
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

    figures: dict[str, float] = {}
    for a, b, ia, ib, key in [
        ("ours", "floor_copy", 0, 0, "ours blocking/floor_copy"),
        ("ours", "floor_write", 1, 1, "ours committed/floor_write"),
        ("torch_sync", "floor_write", 1, 1, "torch_sync committed/floor_write"),
        ("dcp_async", "floor_write", 1, 1, "dcp_async committed/floor_write"),
    ]:
        if a in methods and b in methods:
            figures[key] = paired(a, b, ia, ib)
    specs = [
        ("ours blocking / floor copy", "ours", "floor_copy", 0, 0, 1.3, False),
        ("sync torch.save blocking / ours blocking", "torch_sync", "ours", 0, 0, 5.0, True),
        ("ours committed / (sequential write + fsync)", "ours", "floor_write", 1, 1, 1.5, False),
        ("fabric.save blocking: default / ours", "fabric_torch", "fabric_ours", 0, 0, 5.0, True),
        (
            "fabric.save blocking: default / ours, default keys",
            "fabric_torch",
            "fabric_ours_default_keys",
            0,
            0,
            5.0,
            True,
        ),
    ]
    out += ratio_table((name, paired(a, b, ia, ib), target, higher)
                       for name, a, b, ia, ib, target, higher in specs if a in methods and b in methods)  # fmt: skip
    return "\n".join(out), figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--tensors", default="24", help="number of tensors, or a comma list for the curve (24,400,4000)")
    p.add_argument("--ranks", default="", help="also DDP saves on these rank counts, comma list (e.g. 2,4)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds after the warm-up (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 16 tensors")
    p.add_argument("--methods", default="", help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--ours-threads", type=int, default=None, help="thread_count for ours (default: the plugin's)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every round to stderr")
    p.add_argument("--device", default=None, help="cuda (or cpu, a dry run): the device table instead (bench_device.py)")
    p.add_argument("--host-budget", action="store_true", help="the host-memory budget section instead")
    p.add_argument("--no-step-time", dest="step_time", action="store_false", help="skip the step-time section")
    step_time.add_arguments(p, prefix="step-")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.tensors = 128, "16"
        args.step_width, args.step_repeats = 1024, 3
    if args.device is not None or args.host_budget:
        from bench_device import run_device
        from bench_host_budget import run_budget

        sections = [run_device(args)] if args.device is not None else []
        print("\n\n".join([*sections, *([run_budget(args)] if args.host_budget else [])]))
        return 0
    print(run(args))
    if args.step_time:
        print()
        print(step_time.from_args(args, prefix="step_")()[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
