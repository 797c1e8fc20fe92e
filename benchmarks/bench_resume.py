"""Restart costs: how fast a checkpoint loads, and how long the first save blocks.

(a) Resume, 1 process: ``ShardedAsyncCheckpointIO.load_checkpoint`` with and without
    verification against Lightning's ``TorchCheckpointIO`` (torch.load of one ``.ckpt``),
    DCP ``load`` (into preallocated tensors, DCP's natural mode) and the read floor of our
    checkpoint's files (sequential ``read()`` into fresh memory, as any loader must; a
    ``readinto`` of a reused buffer is shown too). Warm: files in the page cache; cold:
    evicted with ``posix_fadvise(DONTNEED)`` before each load (the VM host may still
    cache them).
(b) Resume, N ranks (gloo, as DDP does it; ``--ranks``, default 2 and 4): every rank
    loads the full checkpoint at the same time; the slowest rank counts.
(c) First-save stall: blocking time of the first save of a fresh plugin, without and
    with ``prepare_staging`` (buffers allocated and touched in the background before), of
    a steady-state save, and the copy floor; under 2 ranks, each rank's staged bytes.

Methods are interleaved round by round after one warm-up round; ratios are medians of
per-round ratios measured in the same run.

``--tensors 24,400,4000`` repeats (a)-(c) for each count (the same total bytes) and ends
with the curve: each ratio per tensor count (the cost per tensor, not per byte).

    python benchmarks/bench_resume.py            # 1 GiB, ~4 min
    python benchmarks/bench_resume.py --size-mib 256 --tensors 24,400,4000 --repeats 2  # the curve
    python benchmarks/bench_resume.py --quick    # 128 MiB smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    MiB,
    fmt_range,
    fmt_s,
    lightning_style_checkpoint,
    machine_notes,
    median,
    nbytes,
    ratio_table,
    table,
    tensors_of,
    workdir,
)


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for base, _, names in os.walk(path):
        out += [os.path.join(base, n) for n in names]
    return sorted(out)


def evict(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (clean pages; no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = tensors_of(a["state_dict"]), tensors_of(b["state_dict"])
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


# ---- (a) resume, one process ------------------------------------------------------------
class Loads:
    def __init__(self, root: str, ckpt: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        from lightning_preempt import ShardedAsyncCheckpointIO

        self.ckpt = ckpt
        self.ours_dir = os.path.join(root, "ours")
        self.pt_file = os.path.join(root, "last.ckpt")
        self.dcp_dir = os.path.join(root, "dcp")
        writer = ShardedAsyncCheckpointIO()
        writer.save_checkpoint(ckpt, self.ours_dir)
        writer.teardown()
        torch.save(ckpt, self.pt_file)
        dcp.save(
            {"state_dict": ckpt["state_dict"], "optimizer_states": ckpt["optimizer_states"]},
            checkpoint_id=self.dcp_dir,
            no_dist=True,
        )
        self.verify_io = ShardedAsyncCheckpointIO(verify_on_load=True)
        self.noverify_io = ShardedAsyncCheckpointIO(verify_on_load=False)
        self.torch_io = TorchCheckpointIO()
        # DCP loads in place: the model and optimizer exist (memory touched) before it runs.
        self.dcp_template = {
            "state_dict": {k: torch.zeros_like(v) for k, v in ckpt["state_dict"].items()},
            "optimizer_states": [
                {
                    "state": {
                        i: {n: torch.zeros_like(t) for n, t in s.items()}
                        for i, s in ckpt["optimizer_states"][0]["state"].items()
                    },
                    "param_groups": ckpt["optimizer_states"][0]["param_groups"],
                }
            ],
        }
        self.reuse = torch.empty(max(os.path.getsize(p) for p in files_under(self.ours_dir)), dtype=torch.uint8)
        self.reuse.zero_()

    def files(self, method: str) -> list[str]:
        if method in ("torch_io", "torch_load"):
            return [self.pt_file]
        if method == "dcp":
            return files_under(self.dcp_dir)
        return files_under(self.ours_dir)

    def floor_read(self) -> Any:
        for p in files_under(self.ours_dir):
            with open(p, "rb") as f:
                f.read()
        return None

    def floor_readinto(self) -> Any:
        view = memoryview(self.reuse.numpy()).cast("B")
        for p in files_under(self.ours_dir):
            with open(p, "rb", buffering=0) as f:
                n = os.path.getsize(p)
                done = 0
                while done < n:
                    done += f.readinto(view[done:n]) or n
        return None

    def ours_verify(self) -> Any:
        return self.verify_io.load_checkpoint(self.ours_dir)

    def ours_noverify(self) -> Any:
        return self.noverify_io.load_checkpoint(self.ours_dir)

    def torch_io_load(self) -> Any:
        return self.torch_io.load_checkpoint(self.pt_file)

    def torch_load(self) -> Any:
        return torch.load(self.pt_file, map_location="cpu", weights_only=True)

    def dcp_load(self) -> Any:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.dcp_template, checkpoint_id=self.dcp_dir, no_dist=True)
        return self.dcp_template


LOAD_METHODS: dict[str, tuple[str, str]] = {
    "floor_read": ("FLOOR: read() every file of our checkpoint", "sequential, into fresh memory"),
    "floor_readinto": ("(info) readinto a reused, touched buffer", "copy from the page cache only"),
    "ours_verify": ("ours, load_checkpoint (verify_on_load=True)", "CRC32C of every byte read, one pass"),
    "ours_noverify": ("ours, load_checkpoint (verify_on_load=False)", "sizes only"),
    "torch_io": ("Lightning TorchCheckpointIO.load_checkpoint", "torch.load of one .ckpt"),
    "torch_load": ("torch.load(weights_only=True)", "same .ckpt"),
    "dcp": ("DCP load into preallocated tensors", "dcp.save'd copy of the same state"),
}


def bench_loads(args: argparse.Namespace, root: str, ckpt: dict[str, Any]) -> tuple[str, dict[str, float]]:
    loads = Loads(root, ckpt)
    runners: dict[str, Callable[[], Any]] = {
        "floor_read": loads.floor_read,
        "floor_readinto": loads.floor_readinto,
        "ours_verify": loads.ours_verify,
        "ours_noverify": loads.ours_noverify,
        "torch_io": loads.torch_io_load,
        "torch_load": loads.torch_load,
        "dcp": loads.dcp_load,
    }
    methods = [m for m in runners if getattr(args, "methods", None) is None or m in args.methods]
    caches = ["warm", "cold"] if not args.no_cold else ["warm"]
    results: dict[tuple[str, str], list[float]] = {(c, m): [] for c in caches for m in methods}
    # CPU seconds of this process per load: the work done, much less moved by other processes
    # on a loaded machine than the wall time is (the loaders read on the calling thread).
    cpu_s: dict[tuple[str, str], list[float]] = {(c, m): [] for c in caches for m in methods}
    befores: dict[str, list[bool]] = {c: [] for c in caches}  # per measured round: verify ran before noverify
    for rnd in range(args.repeats + 1):
        for cache in caches:
            order = methods[rnd % len(methods) :] + methods[: rnd % len(methods)]
            if rnd > 0 and {"ours_verify", "ours_noverify"} <= set(order):
                befores[cache].append(order.index("ours_verify") < order.index("ours_noverify"))
            for m in order:
                paths = loads.files(m)
                if cache == "cold":
                    evict(paths)
                else:
                    warm(paths)
                gc.collect()
                t0, c0 = time.perf_counter(), time.process_time()
                out = runners[m]()
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                if rnd == 0 and out is not None and not same(ckpt, out):
                    raise SystemExit(f"{m} loaded different tensors")
                del out
                if rnd > 0:
                    results[(cache, m)].append(dt)
                    cpu_s[(cache, m)].append(cpu)
    total = sum(os.path.getsize(p) for p in files_under(loads.ours_dir))
    rows = []
    for cache in caches:
        for m in methods:
            label, note = LOAD_METHODS[m]
            xs = results[(cache, m)]
            rows.append([cache, label, fmt_s(median(xs)), fmt_range(xs), f"{total / median(xs) / 1e9:.2f}", note])

    def ratio(cache: str, a: str, b: str) -> float:
        return median([x / y for x, y in zip(results[(cache, a)], results[(cache, b)], strict=True)])

    figures = {
        f"{cache} {a}/{b}": ratio(cache, a, b)
        for cache in caches
        for a, b in [
            ("ours_verify", "floor_read"),
            ("ours_noverify", "floor_read"),
            ("ours_verify", "torch_load"),
            ("ours_verify", "torch_io"),
            ("ours_verify", "dcp"),
            ("ours_noverify", "ours_verify"),
        ]
        if a in methods and b in methods
    }
    text = "\n".join(
        [
            f"#### (a) resume, 1 process: {nbytes(ckpt) / MiB:.0f} MiB state in {len(tensors_of(ckpt))} tensors "
            f"({total / MiB:.0f} MiB of files), {args.repeats} measured rounds after 1 warm-up (median, min-max)",
            "",
            table(["cache", "method", "load (s)", "range", "GB/s", "notes"], rows),
            "",
            *_verify_order_table(results, cpu_s, befores),
        ]
    )
    return text, figures


def _verify_order_table(
    results: dict[tuple[str, str], list[float]],
    cpu_s: dict[tuple[str, str], list[float]],
    befores: dict[str, list[bool]],
) -> list[str]:
    """verify_on_load=False against True, round by round, split by which of the two ran first
    in the round (the methods' order rotates): an order effect shows as two different rows.
    Wall seconds, and the CPU seconds of the same loads."""
    rows = []
    for cache, before in befores.items():
        for what, source in (("wall", results), ("CPU", cpu_s)):
            verify, noverify = source.get((cache, "ours_verify"), []), source.get((cache, "ours_noverify"), [])
            if not before or len(verify) != len(before):
                continue
            for label, want in (("verify first", True), ("noverify first", False), ("all", None)):
                pairs = [(v, n) for v, n, b in zip(verify, noverify, before, strict=True) if want is None or b == want]
                if pairs:
                    ratios = [n / v for v, n in pairs]
                    rows.append([cache, what, label, str(len(pairs)), fmt_s(median([v for v, _ in pairs])),
                                 fmt_s(median([n for _, n in pairs])), f"{median(ratios):.2f}", fmt_range(ratios)])  # fmt: skip
    if not rows:
        return []
    head = ["cache", "time", "order in the round", "rounds", "verify=True (s)", "verify=False (s)", "False / True",
            "range of False / True"]  # fmt: skip
    return ["verify_on_load=False against True, by which ran first in the round (medians):", "", table(head, rows), ""]


# ---- (c) first-save stall, one process ---------------------------------------------------
def bench_first_save(args: argparse.Namespace, root: str, ckpt: dict[str, Any]) -> tuple[str, dict[str, float]]:
    from lightning_preempt import ShardedAsyncCheckpointIO

    tensors = tensors_of(ckpt)
    floor_bufs = [torch.empty_like(t) for t in tensors]
    for b in floor_bufs:
        b.zero_()
    counter = [0]

    def path() -> str:
        counter[0] += 1
        return os.path.join(root, f"save-{counter[0]:04d}")

    def floor() -> float:
        t0 = time.perf_counter()
        for b, t in zip(floor_bufs, tensors, strict=True):
            b.copy_(t)
        return time.perf_counter() - t0

    def first(prepare: str) -> dict[str, float]:
        io = ShardedAsyncCheckpointIO()
        out: dict[str, float] = {}
        if prepare != "none":
            t0 = time.perf_counter()
            fut = io.prepare_staging(ckpt, background=True)
            out["prepare_call"] = time.perf_counter() - t0
            if prepare == "done":
                fut.result()
                out["prepare_done"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        io.save_checkpoint(ckpt, path())
        out["first"] = time.perf_counter() - t0
        io.wait()
        ckpt["global_step"] += 1
        t0 = time.perf_counter()
        io.save_checkpoint(ckpt, path())
        out["steady"] = time.perf_counter() - t0
        io.teardown()
        return out

    # Every first save is paired with a copy floor measured right before it.
    results: dict[str, list[float]] = {k: [] for k in ("floor", "none", "done", "racing", "steady", "prepare_done")}
    ratios: dict[str, list[float]] = {k: [] for k in ("none", "done", "racing", "steady")}
    order = ["none", "done", "racing"]
    for rnd in range(args.repeats + 1):
        for kind in order[rnd % 3 :] + order[: rnd % 3]:
            fl = floor()
            r = first(kind)
            gc.collect()
            for entry in os.listdir(root):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
            if rnd == 0:
                continue
            results["floor"].append(fl)
            results[kind].append(r["first"])
            results["steady"].append(r["steady"])
            ratios[kind].append(r["first"] / fl)
            ratios["steady"].append(r["steady"] / fl)
            if "prepare_done" in r:
                results["prepare_done"].append(r["prepare_done"])
    floors = results["floor"]

    def ratio_to_floor(kind: str) -> float:
        return median(ratios[kind])

    def row(label: str, kind: str, note: str) -> list[str]:
        times = results[kind]
        return [label, fmt_s(median(times)), fmt_range(times), f"{ratio_to_floor(kind):.2f}", note]

    rows = [
        [
            "FLOOR: copy into preallocated, touched buffers",
            fmt_s(median(floors)),
            fmt_range(floors),
            "1.00",
            "blocking floor",
        ],
        row("ours, first save, no preparation", "none", "buffers allocated inside the save (before this issue)"),
        row(
            "ours, first save after prepare_staging",
            "done",
            f"background preparation took {fmt_s(median(results['prepare_done']))} s, off the training thread",
        ),
        row("ours, first save while prepare_staging still runs", "racing",
            "signal right after on_train_start: waits for the preparation"),
        row("ours, steady-state save", "steady", "second save, buffers reused"),
    ]
    text = "\n".join(
        [
            f"#### (c) first-save stall, 1 process: {nbytes(ckpt) / MiB:.0f} MiB, {args.repeats} rounds after 1 warm-up",
            "",
            table(["save", "blocks (s)", "range", "/ floor", "notes"], rows),
            "",
        ]
    )
    return text, {
        "first/floor": ratio_to_floor("none"),
        "prepared first/floor": ratio_to_floor("done"),
        "steady/floor": ratio_to_floor("steady"),
    }


# ---- (b) + (c) N ranks ---------------------------------------------------------------------
def _rank_worker(
    rank: int, init_file: str, root: str, size_mib: int, n_tensors: int, repeats: int, cold: bool, world: int
) -> None:
    import torch.distributed as dist
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_preempt import ShardedAsyncCheckpointIO
    from lightning_preempt.collective.groups import new_gloo_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ckpt = lightning_style_checkpoint(size_mib * MiB, n_tensors)  # same seed on both ranks: replicated
    ours_dir, pt_file = os.path.join(root, "ours2"), os.path.join(root, "last2.ckpt")
    io = ShardedAsyncCheckpointIO()
    io.enable_collective_saves(new_gloo_group())
    prep = io.prepare_staging(ckpt, background=True)
    prep.result()
    t0 = time.perf_counter()
    io.save_checkpoint(ckpt, ours_dir)
    blocking = time.perf_counter() - t0
    staged = io.staging_last_bytes
    io.wait()
    if rank == 0:
        torch.save(ckpt, pt_file)
    dist.barrier()
    verify_io, noverify_io, torch_io = (
        ShardedAsyncCheckpointIO(),
        ShardedAsyncCheckpointIO(verify_on_load=False),
        TorchCheckpointIO(),
    )

    def floor() -> Any:
        for p in files_under(ours_dir):
            with open(p, "rb") as f:
                f.read()

    runners: dict[str, Callable[[], Any]] = {
        "floor_read": floor,
        "ours_verify": lambda: verify_io.load_checkpoint(ours_dir),
        "ours_noverify": lambda: noverify_io.load_checkpoint(ours_dir),
        "torch_io": lambda: torch_io.load_checkpoint(pt_file),
    }
    caches = ["warm", "cold"] if cold else ["warm"]
    times: dict[str, list[float]] = {f"{c} {m}": [] for c in caches for m in runners}
    methods = list(runners)
    for rnd in range(repeats + 1):
        for cache in caches:
            for m in methods[rnd % len(methods) :] + methods[: rnd % len(methods)]:
                paths = [pt_file] if m == "torch_io" else files_under(ours_dir)
                if rank == 0:
                    (evict if cache == "cold" else warm)(paths)
                gc.collect()
                dist.barrier()
                t0 = time.perf_counter()
                out = runners[m]()
                dt = time.perf_counter() - t0
                if rnd == 0 and out is not None and not same(ckpt, out):
                    raise SystemExit(f"rank {rank}: {m} loaded different tensors")
                del out
                slowest = [0.0] * world
                dist.all_gather_object(slowest, dt)
                if rnd > 0:
                    times[f"{cache} {m}"].append(max(slowest))
    result = {"rank": rank, "staged": staged, "state": nbytes(ckpt), "blocking": blocking, "times": times}
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    io.teardown()
    dist.destroy_process_group()


def bench_ranks(args: argparse.Namespace, root: str, world: int) -> tuple[str, dict[str, float]]:
    import torch.multiprocessing as mp

    sub = os.path.join(root, f"ranks{world}")
    os.makedirs(sub)
    mp.start_processes(
        _rank_worker,
        args=(os.path.join(sub, "init"), sub, args.size_mib, args.tensors, args.repeats, not args.no_cold, world),
        nprocs=world,
        start_method="spawn",
    )
    res = [json.loads(Path(sub, f"rank{r}.json").read_text()) for r in range(world)]
    times = res[0]["times"]
    labels = {
        "floor_read": "FLOOR: read() every file (each rank)",
        "ours_verify": "ours, load_checkpoint (verify_on_load=True)",
        "ours_noverify": "ours, load_checkpoint (verify_on_load=False)",
        "torch_io": "Lightning TorchCheckpointIO.load_checkpoint",
    }
    rows = []
    for key, xs in times.items():
        cache, m = key.split(" ")
        rows.append([cache, labels[m], fmt_s(median(xs)), fmt_range(xs)])

    def ratio(cache: str, a: str, b: str) -> float:
        return median([x / y for x, y in zip(times[f"{cache} {a}"], times[f"{cache} {b}"], strict=True)])

    caches = sorted({k.split(" ")[0] for k in times}, reverse=True)
    figures = {f"{world} ranks {c} ours_verify/floor_read": ratio(c, "ours_verify", "floor_read") for c in caches}
    figures |= {f"{world} ranks {c} ours_verify/torch_io": ratio(c, "ours_verify", "torch_io") for c in caches}
    share = max(r["staged"] for r in res) / res[0]["state"]
    figures[f"{world} ranks staged share"] = share
    text = "\n".join(
        [
            f"#### (b) resume, {world} ranks (gloo; all load at once, the slowest rank counts), "
            f"{args.repeats} rounds after 1 warm-up",
            "",
            table(["cache", "method", "load (s)", "range"], rows),
            "",
            f"(c) DDP save, {world} ranks: staged bytes per rank "
            + ", ".join(
                f"rank {r['rank']} {r['staged'] / MiB:.0f} MiB ({r['staged'] / r['state']:.2f} of the state), blocked {r['blocking']:.3f} s"
                for r in res
            )
            + f"; state {res[0]['state'] / MiB:.0f} MiB per rank.",
            "",
        ]
    )
    return text, figures


def run(args: argparse.Namespace) -> str:
    """One report per tensor count, then the curve (ratios per count) when there are several."""
    counts = [int(n) for n in str(args.tensors).split(",")]
    reports, curve = [], {}
    for n in counts:
        one = argparse.Namespace(**{**vars(args), "tensors": n})
        text, figures = run_one(one)
        reports.append(text)
        curve[n] = figures
    if len(counts) > 1:
        reports.append(curve_table(args, curve))
    return "\n\n".join(reports)


#: The curve's rows: (label, figure key) — the ratios the targets are set on.
CURVE = [
    ("warm: ours (verify) / torch.load", "warm ours_verify/torch_load"),
    ("cold: ours (verify) / torch.load", "cold ours_verify/torch_load"),
    ("warm: ours (verify) / read floor", "warm ours_verify/floor_read"),
    ("cold: ours (verify) / read floor", "cold ours_verify/floor_read"),
    ("warm: ours (verify) / TorchCheckpointIO", "warm ours_verify/torch_io"),
    ("steady-state save blocking / copy floor", "steady/floor"),
]


def curve_table(args: argparse.Namespace, curve: dict[int, dict[str, float]]) -> str:
    counts = list(curve)
    keys = [*CURVE]
    for world in _worlds(args):
        keys += [
            (f"{world} ranks warm: ours (verify) / TorchCheckpointIO", f"{world} ranks warm ours_verify/torch_io"),
            (f"{world} ranks cold: ours (verify) / TorchCheckpointIO", f"{world} ranks cold ours_verify/torch_io"),
        ]
    rows = []
    for label, key in keys:
        if any(key in curve[n] for n in counts):
            rows.append([label, *(f"{curve[n][key]:.2f}" if key in curve[n] else "—" for n in counts)])
    return "\n".join(
        [
            f"### The curve: {args.size_mib} MiB in {', '.join(map(str, counts))} tensors "
            "(median of per-round ratios; each column is one run of (a)-(c) above)",
            "",
            table(["ratio", *(f"{n} tensors" for n in counts)], rows),
        ]
    )


def _worlds(args: argparse.Namespace) -> list[int]:
    return [int(w) for w in str(args.ranks).split(",") if w.strip() and int(w) > 1]


def run_one(args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    started = time.perf_counter()
    machine = machine_notes()
    parts: list[str] = []
    figures: dict[str, float] = {}
    with workdir(args.dir, "lp-bench-resume-") as root:
        ckpt = lightning_style_checkpoint(args.size_mib * MiB, args.tensors)
        if "a" in args.parts:
            d = os.path.join(root, "a")
            os.makedirs(d)
            text, f = bench_loads(args, d, ckpt)
            parts.append(text)
            figures |= f
            shutil.rmtree(d, ignore_errors=True)
        if "c" in args.parts:
            d = os.path.join(root, "c")
            os.makedirs(d)
            text, f = bench_first_save(args, d, ckpt)
            parts.append(text)
            figures |= f
        del ckpt
        gc.collect()
        if "b" in args.parts:
            for world in _worlds(args):
                text, f = bench_ranks(args, root, world)
                parts.append(text)
                figures |= f
    elapsed = time.perf_counter() - started
    specs = [
        ("warm: ours (verify) / read floor", "warm ours_verify/floor_read", 1.5, False),
        ("cold: ours (verify) / read floor", "cold ours_verify/floor_read", 1.5, False),
        ("warm: ours (verify) / torch.load", "warm ours_verify/torch_load", 1.0, False),
        ("cold: ours (verify) / torch.load", "cold ours_verify/torch_load", 1.0, False),
        ("warm: ours (verify) / TorchCheckpointIO", "warm ours_verify/torch_io", 1.0, False),
        ("first save after prepare_staging / copy floor", "prepared first/floor", 1.2, False),
        ("steady-state save / copy floor", "steady/floor", 1.0, False),
    ]
    for world in _worlds(args):
        specs += [
            (f"{world} ranks warm: ours (verify) / read floor", f"{world} ranks warm ours_verify/floor_read", 1.5, False),
            (f"{world} ranks cold: ours (verify) / read floor", f"{world} ranks cold ours_verify/floor_read", 1.5, False),
            (f"{world} ranks warm: ours (verify) / TorchCheckpointIO", f"{world} ranks warm ours_verify/torch_io", 1.2,
             False),
            (f"{world} ranks cold: ours (verify) / TorchCheckpointIO", f"{world} ranks cold ours_verify/torch_io", 1.2,
             False),
            (f"DDP {world} ranks: largest rank's staged bytes / state", f"{world} ranks staged share", 1.2 / world,
             False),
        ]  # fmt: skip
    info = [
        f"- {k}: {v:.2f}"
        for k, v in figures.items()
        if k in ("first/floor", "warm ours_noverify/floor_read", "warm ours_verify/dcp", "cold ours_verify/dcp")
    ]
    header = [
        f"### bench_resume ({args.size_mib} MiB, {args.tensors} tensors)",
        "",
        f"Machine: {machine}; run took {elapsed:.0f}s; loadavg at the end {os.getloadavg()[0]:.2f}",
        "",
    ]
    checks = [(name, figures[key], target, higher) for name, key, target, higher in specs if key in figures]
    return "\n".join(header + parts + ratio_table(checks) + (["", "Other ratios (information):", *info] if info else [])), figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--tensors", default="24", help="tensor count, or a comma list for the curve (e.g. 24,400,4000)")
    p.add_argument("--ranks", default="2,4", help="rank counts for (b), comma list (default 2,4; 1 is (a))")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--parts", default="abc", help="which parts to run: a (1-process loads), b (2 ranks), c (first save)"
    )
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache rounds")
    p.add_argument(
        "--methods",
        type=lambda v: v.split(","),
        default=None,
        help=f"(a) only these load methods, comma list of {','.join(LOAD_METHODS)} (default: all)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 16 tensors, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.tensors, args.repeats, args.ranks = 128, "16", 2, "2"
    print(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
