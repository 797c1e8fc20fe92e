"""Steady-state save cost: how long ``save_checkpoint`` blocks and how long until durable.

Compares ``ShardedAsyncCheckpointIO`` with Lightning's ``TorchCheckpointIO`` (plus fsync),
Lightning's ``AsyncCheckpointIO`` (plus fsync), DCP ``async_save`` with a CPU stager, and
two floors: a copy into preallocated buffers (the least a snapshot can block) and a plain
sequential write + fsync of the same bytes (the least a durable save can take). Methods are
interleaved round by round (round 0 is the warm-up); ratios are medians of per-round ratios.

``--tensors 24,400,4000`` measures each count (the same total bytes) and ends with the curve
(the cost per tensor, not per byte). ``--ranks 2,4`` adds collective saves on that many gloo
ranks (every rank writes its share, as under ``PreemptionCallback``; each save is checked to hold every
rank's shard files), the slowest rank against a write + fsync of its share.

``--strategy fsdp``: inside a ``Trainer.fit`` on 2 ranks (FSDP1, sharded; on CPU over gloo with
tests/support/cpu_fsdp.py, on 2 GPUs the real one), rounds of our save (blocking, committed)
and resume against Lightning's own sharded ``FSDPStrategy`` save and load of the same state,
its checkpoint dict alone, a copy of the rank's shard, and a rank's peak RSS during a save.

    python benchmarks/bench_save.py            # ~1 GiB, 24 tensors, ~3 min
    python benchmarks/bench_save.py --size-mib 256 --tensors 24,400,4000 --ranks 2,4  # the curve
    python benchmarks/bench_save.py --quick    # 128 MiB smoke run
    python benchmarks/bench_save.py --strategy fsdp --size-mib 256   # FSDP1, 2 ranks
"""

from __future__ import annotations

import argparse
import json
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
    PeakRSS,
    empty_dir,
    fmt_range,
    fmt_s,
    fsync_path,
    header,
    interleaved,
    lightning_job,
    lightning_style_checkpoint,
    median,
    nbytes,
    paired,
    ratio_table,
    rss,
    shard_writers,
    spawn_gloo,
    table,
    tensors_of,
    write_fsync,
)

Result = tuple[float, float]  # blocking_s, committed_s

METHODS: dict[str, tuple[str, str]] = {  # key: (label, note)
    "floor_copy": ("FLOOR: copy into preallocated buffers", "blocking floor; no I/O"),
    "floor_write": ("FLOOR: sequential write + fsync", "commit floor; one file, same bytes"),
    "ours": ("ShardedAsyncCheckpointIO", "committed = manifest durable (`.wait()`)"),
    "torch_sync": ("Lightning TorchCheckpointIO", "sync torch.save; + fsync file & dir (added for fairness)"),
    "lightning_async": ("Lightning AsyncCheckpointIO", "wraps TorchCheckpointIO + fsync; clones tensors"),
    "dcp_async": ("DCP async_save, CPU DefaultStager", "blocks = returned + staging done; sync_files=True"),
}


class Bench:
    """The state and one runner per method; every runner returns a :data:`Result`."""

    def __init__(self, root: str, ckpt: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from lightning_preempt import ShardedAsyncCheckpointIO

        class FsyncTorchCheckpointIO(TorchCheckpointIO):
            """Lightning's torch.save plugin plus an fsync of the file and its directory."""

            def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
                super().save_checkpoint(checkpoint, path, storage_options)
                fsync_path(str(path))
                fsync_path(os.path.dirname(str(path)))

        self.root, self.ckpt, self.counter, self.dcp = root, ckpt, 0, dcp
        self.tensors = tensors_of(ckpt)
        self.buffers = [torch.empty_like(t) for t in self.tensors]
        self.ours = ShardedAsyncCheckpointIO()
        self.torch_io = FsyncTorchCheckpointIO()
        self.async_io = AsyncCheckpointIO(FsyncTorchCheckpointIO())
        # No accelerator: non-blocking copies must be off (see shared/FINDINGS.md).
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))  # fmt: skip
        self.staging_bytes: list[int] = []

    def fresh(self, name: str) -> str:
        self.counter += 1
        return os.path.join(self.root, f"{name}-{self.counter:04d}")

    def touch(self) -> None:
        """A cheap 'training step': change one element of every tensor."""
        for t in self.tensors:
            t.view(-1)[0] += 1.0
        self.ckpt["global_step"] += 1

    def floor_copy(self) -> Result:
        t0 = time.perf_counter()
        for buf, t in zip(self.buffers, self.tensors, strict=True):
            buf.copy_(t)
        dt = time.perf_counter() - t0
        return dt, float("nan")

    def floor_write(self) -> Result:
        path = self.fresh("floor-write")
        os.makedirs(path)
        t0 = time.perf_counter()
        write_fsync(os.path.join(path, "data.bin"), self.tensors)
        dt = time.perf_counter() - t0
        return dt, dt

    def ours_save(self) -> Result:
        t0 = time.perf_counter()
        self.ours.save_checkpoint(self.ckpt, self.fresh("ours"))
        t1 = time.perf_counter()
        self.ours.wait()
        self.staging_bytes.append(self.ours.staging_allocated_bytes)
        return t1 - t0, time.perf_counter() - t0

    def torch_sync(self) -> Result:
        t0 = time.perf_counter()
        self.torch_io.save_checkpoint(self.ckpt, os.path.join(self.fresh("torch"), "last.ckpt"))
        dt = time.perf_counter() - t0
        return dt, dt

    def lightning_async(self) -> Result:
        t0 = time.perf_counter()
        self.async_io.save_checkpoint(self.ckpt, os.path.join(self.fresh("pl-async"), "last.ckpt"))
        t1 = time.perf_counter()
        self.async_io.teardown()  # joins the executor: the save (incl. fsync) is done
        return t1 - t0, time.perf_counter() - t0

    def dcp_async(self) -> Result:
        t0 = time.perf_counter()
        response: Any = self.dcp.async_save(self.ckpt, checkpoint_id=self.fresh("dcp"), async_stager=self.stager,
                                            no_dist=True)  # fmt: skip
        response.staging_completion.result()  # tensors may not change before this
        t1 = time.perf_counter()
        response.upload_completion.result()
        return t1 - t0, time.perf_counter() - t0

    def close(self) -> None:
        self.ours.teardown()
        self.async_io.teardown()
        self.stager.close()


def run_one(args: argparse.Namespace, n_tensors: int) -> tuple[str, dict[str, float]]:
    """One table for ``n_tensors`` and its ratio table; the curve's figures."""
    root = tempfile.mkdtemp(prefix="lp-bench-save-", dir=args.dir or "/tmp")
    ckpt = lightning_style_checkpoint(args.size_mib * MiB, n_tensors)
    total, bench = nbytes(ckpt), Bench(root, ckpt)
    methods = [m for m in METHODS if not args.methods or m in args.methods.split(",")]
    runners = {"floor_copy": bench.floor_copy, "floor_write": bench.floor_write, "ours": bench.ours_save,
               "torch_sync": bench.torch_sync, "lightning_async": bench.lightning_async, "dcp_async": bench.dcp_async}  # fmt: skip
    started = time.perf_counter()
    try:
        results = interleaved({m: runners[m] for m in methods}, args.repeats, before=lambda _: bench.touch(),
                              between=lambda: empty_dir(root))  # fmt: skip
    finally:
        bench.close()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for m in methods:
        blocks, commits = [r[0] for r in results[m]], [r[1] for r in results[m] if r[1] == r[1]]
        gbps = f"{total / median(commits) / 1e9:.2f}" if commits else "—"
        rows.append([METHODS[m][0], fmt_s(median(blocks)), fmt_range(blocks), fmt_s(median(commits)),
                     fmt_range(commits), gbps, METHODS[m][1]])  # fmt: skip
    out = header(f"bench_save: {total / MiB:.0f} MiB in {len(bench.tensors)} float32 tensors, {args.repeats} measured "
                 "rounds after 1 warm-up (median, min-max)", f"run took {time.perf_counter() - started:.0f}s")  # fmt: skip
    out += [table(["method", "blocks (s)", "range", "committed (s)", "range", "GB/s to durable", "notes"], rows), ""]
    if "ours" in methods:
        sb = bench.staging_bytes
        out += [f"Staging memory allocated by ShardedAsyncCheckpointIO after each measured save: "
                f"{', '.join(f'{b / MiB:.0f} MiB' for b in sb)} ({'GREW' if len(set(sb)) > 1 else 'constant'} "
                f"after the first save; state is {total / MiB:.0f} MiB)", ""]  # fmt: skip

    def ratio(a: str, b: str, i: int) -> float:
        return paired([r[i] for r in results[a]], [r[i] for r in results[b]])

    specs = [  # name, a, b, 0 blocking / 1 committed, target, higher is better, curve key
        ("ours blocking / floor copy", "ours", "floor_copy", 0, 1.3, False),
        ("sync torch.save blocking / ours blocking", "torch_sync", "ours", 0, 5.0, True),
        ("ours committed / (sequential write + fsync)", "ours", "floor_write", 1, 1.5, False),
        ("TorchCheckpointIO committed / (write + fsync)", "torch_sync", "floor_write", 1, None, False),
        ("DCP async_save committed / (write + fsync)", "dcp_async", "floor_write", 1, None, False),
    ]
    figures = {name: ratio(a, b, i) for name, a, b, i, _, _ in specs if a in methods and b in methods}
    out += ratio_table((name, figures[name], t, hi) for name, _, _, _, t, hi in specs if t and name in figures)
    return "\n".join(out), figures


def _rank_worker(rank: int, world: int, root: str, size_mib: int, n_tensors: int, repeats: int) -> None:
    """One rank: rounds of a collective save of the replicated state (the slowest rank counts)
    and the floors for this rank's share: a copy into buffers and a write + fsync of its bytes."""
    import torch.distributed as dist

    from lightning_preempt import ShardedAsyncCheckpointIO
    from lightning_preempt.collective.groups import new_gloo_group

    ckpt = lightning_style_checkpoint(size_mib * MiB, n_tensors)  # same seed on every rank: replicated
    io = ShardedAsyncCheckpointIO()
    io.enable_collective_saves(new_gloo_group())
    tensors, share, buffers = tensors_of(ckpt), [], []
    times: dict[str, list[float]] = {"blocking": [], "committed": [], "floor_copy": [], "floor_write": []}
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
        write_fsync(os.path.join(root, f"floor-{rank}-{rnd}"), share)
        mine = [t1 - t0, t2 - t0, t4 - t3, time.perf_counter() - t4]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rnd > 0:
            for i, key in enumerate(times):
                times[key].append(max(g[i] for g in gathered))  # the slowest rank's
        dist.barrier()
        if rank == 0:
            shard_writers(path, world)
            shutil.rmtree(path, ignore_errors=True)
        os.remove(os.path.join(root, f"floor-{rank}-{rnd}"))
    if rank == 0:
        with open(os.path.join(root, "ranks.json"), "w") as f:
            json.dump(times, f)
    io.teardown()


def bench_ranks(args: argparse.Namespace, n_tensors: int, world: int) -> tuple[dict[str, float], str]:
    root = tempfile.mkdtemp(prefix=f"lp-bench-save-ranks{world}-", dir=args.dir or "/tmp")
    try:
        spawn_gloo(_rank_worker, world, root, args.size_mib, n_tensors, args.repeats)
        with open(os.path.join(root, "ranks.json")) as f:
            times = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures = {f"{world} ranks: slowest rank committed / its share's write + fsync":
               paired(times["committed"], times["floor_write"]),
               f"{world} ranks: slowest rank blocking / copy of its share": paired(times["blocking"], times["floor_copy"])}  # fmt: skip
    line = (f"Collective save, {n_tensors} tensors on {world} gloo ranks, each writing its share (slowest rank, "
            f"median of {args.repeats}): blocks {median(times['blocking']):.3f} s, committed "
            f"{median(times['committed']):.3f} s; floors for its share: copy {median(times['floor_copy']):.3f} s, "
            f"write + fsync {median(times['floor_write']):.3f} s")  # fmt: skip
    return figures, line


def strategy_save(args: argparse.Namespace) -> int:
    """``--strategy fsdp`` (the module docstring); Lightning starts the second rank, which runs this too."""
    import lightning as L
    from cpu_fsdp import CPUFSDPStrategy  # tests/support
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.utils.data import DataLoader

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning
    from lightning_preempt.collective import groups as pdist

    cuda, width = torch.cuda.is_available(), 1024
    strategy = (FSDPStrategy if cuda else CPUFSDPStrategy)(auto_wrap_policy={torch.nn.Linear}, state_dict_type="sharded")
    # One root on every rank: made by the launching process, inherited by the rank it starts.
    if "LP_BENCH_ROOT" not in os.environ:
        os.environ["LP_BENCH_ROOT"] = tempfile.mkdtemp(prefix="lp-bench-fsdp-", dir=args.dir or "/tmp")
    root = os.environ["LP_BENCH_ROOT"]
    keys = ("ours: training blocked", "ours: committed after", "Lightning's dict alone (in both saves)",
            "Lightning's sharded save (all blocking)", "floor: one copy of the rank's shard", "ours: resume (load)",
            "Lightning's sharded load")  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in keys}

    class Measure(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            io = strategy.checkpoint_io
            io.wait()
            rss0, shard, bufs, growth = rss(), [], [], 0  # rss0: model, optimizer, staging buffers (made at start)
            for rnd in range(args.repeats + 1):
                ours, theirs = f"{root}/ours-{rnd}", f"{root}/lightning-{rnd}"
                strategy.barrier()
                with PeakRSS() as peak:
                    t = [time.perf_counter()]
                    trainer.save_checkpoint(ours, weights_only=False)
                    t.append(time.perf_counter())
                    io.wait()
                    t.append(time.perf_counter())
                if rnd == 0:
                    growth = max(pdist.all_gather_objects(peak.peak - rss0 + io.staging_allocated_bytes, None))
                    state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
                    shard = [x.to_local() if hasattr(x, "to_local") else x for x in tensors_of(state)]
                    bufs = [torch.empty_like(x) for x in shard]
                    if trainer.is_global_zero:
                        shard_writers(ours, 2)
                strategy.barrier()
                t.append(time.perf_counter())
                ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
                t.append(time.perf_counter())
                FSDPStrategy.save_checkpoint(strategy, ckpt, theirs)  # Lightning's own sharded save
                t.append(time.perf_counter())
                del ckpt
                strategy.barrier()
                t.append(time.perf_counter())
                torch._foreach_copy_(bufs, shard)
                t.append(time.perf_counter())
                strategy.barrier()
                t.append(time.perf_counter())
                strategy.load_checkpoint(ours)
                t.append(time.perf_counter())
                strategy.barrier()
                t.append(time.perf_counter())
                FSDPStrategy.load_checkpoint(strategy, theirs, weights_only=False)
                t.append(time.perf_counter())
                spans = (t[1] - t[0], t[2] - t[0], t[4] - t[3], t[5] - t[3], t[7] - t[6], t[9] - t[8], t[11] - t[10])
                for key, span in zip(keys, spans, strict=True):
                    if rnd:  # round 0 warms every path up
                        times[key].append(max(pdist.all_gather_objects(span, None)))  # the slower rank's
            size = max(pdist.all_gather_objects(sum(x.numel() * x.element_size() for x in shard), None))
            staging = max(pdist.all_gather_objects(io.staging_allocated_bytes, None))
            if not trainer.is_global_zero:
                return
            rows = [[k, fmt_s(median(v)), fmt_range(v)] for k, v in times.items()]
            checks = [("ours blocked / Lightning's save", paired(times[keys[0]], times[keys[3]]), 0.25, False),
                      ("ours resume / Lightning's load", paired(times[keys[5]], times[keys[6]]), 1.2, False),
                      ("peak RSS growth / (shard + staging)", growth / (size + staging), 1.0, False)]  # fmt: skip
            title = f"bench_save --strategy fsdp: 2 ranks, {n_layers} Linear {width}x{width}, SGD momentum, "
            print("\n".join([*header(title + f"{args.repeats} rounds after 1 warm-up (slower rank)"),
                             f"A rank's shard (model + optimizer): {size / MiB:.0f} MiB; its staging buffers "
                             f"{staging / MiB:.0f} MiB; peak RSS growth in our first save (+ the buffers): "
                             f"{growth / MiB:.0f} MiB", "", table(["seconds", "median", "range"], rows), "",
                             *ratio_table(checks)]))  # fmt: skip

    Big, Noise = lightning_job()
    n_layers = max(2, args.size_mib * MiB // (4 * width * width))
    trainer = L.Trainer(max_steps=3, accelerator="cuda" if cuda else "cpu", devices=2, strategy=strategy,
                        callbacks=[Measure(), PreemptionCallback(f"{root}/run", keep_last_n=1, tuning=Tuning(save_on_train_end=False))],
                        plugins=[ShardedAsyncCheckpointIO()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(Big(width, n_layers, lr=1e-5, momentum=0.9), DataLoader(Noise(width), batch_size=8))
    if trainer.is_global_zero:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--tensors", default="24", help="number of tensors, or a comma list for the curve (24,400,4000)")
    p.add_argument("--ranks", default="", help="also collective saves on these rank counts, comma list (e.g. 2,4)")
    p.add_argument("--repeats", type=int, default=3, help="measured rounds after the warm-up (default 3)")
    p.add_argument("--methods", default="", help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--strategy", choices=("fsdp",), default=None, help="save and resume under FSDP1, 2 ranks")
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 16 tensors")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.tensors = 128, "16"
    if args.strategy:
        return strategy_save(args)
    counts = [int(n) for n in args.tensors.split(",")]
    worlds = [int(w) for w in args.ranks.split(",") if w.strip() and int(w) > 1]
    curve: dict[int, dict[str, float]] = {}
    for n in counts:
        text, curve[n] = run_one(args, n)
        for world in worlds:
            figures, line = bench_ranks(args, n, world)
            curve[n] |= figures
            text += "\n\n" + line
        print(text + "\n", flush=True)
    if len(counts) > 1 or worlds:
        keys = list(dict.fromkeys(k for n in counts for k in curve[n]))
        rows = [[k, *(f"{curve[n][k]:.2f}" if k in curve[n] else "—" for n in counts)] for k in keys]
        print(f"### The curve: {args.size_mib} MiB in {', '.join(map(str, counts))} tensors (median of per-round "
              f"ratios; each column is one run above)\n\n" + table(["ratio", *(f"{n} tensors" for n in counts)], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
