"""Restart costs: how fast a checkpoint loads, and how long the first save blocks.

(a) Resume, 1 process: ``ShardedAsyncCheckpointIO.load_checkpoint`` with and without
    verification against Lightning's ``TorchCheckpointIO`` (torch.load of one ``.ckpt``),
    DCP ``load`` (into preallocated tensors, DCP's natural mode) and the read floor of our
    checkpoint's files (sequential ``read()`` into fresh memory, as any loader must). Warm: files in the page cache; cold:
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
    python benchmarks/bench_resume.py --parts a --tensors 4000 --size-mib 256   # many tensors
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
from _harness import (
    MiB,
    files_under,
    fmt_range,
    fmt_s,
    lightning_style_checkpoint,
    machine_notes,
    median,
    nbytes,
    paired,
    ratio_table,
    spawn_gloo,
    table,
    tensors_of,
    workdir,
)


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

        self.ckpt, self.ours_dir = ckpt, os.path.join(root, "ours")
        self.pt_file, self.dcp_dir = os.path.join(root, "last.ckpt"), os.path.join(root, "dcp")
        writer = ShardedAsyncCheckpointIO()
        writer.save_checkpoint(ckpt, self.ours_dir)
        writer.teardown()
        torch.save(ckpt, self.pt_file)
        dcp.save({"state_dict": ckpt["state_dict"], "optimizer_states": ckpt["optimizer_states"]},
                 checkpoint_id=self.dcp_dir, no_dist=True)  # fmt: skip
        self.verify_io = ShardedAsyncCheckpointIO(verify_on_load=True)
        self.noverify_io = ShardedAsyncCheckpointIO(verify_on_load=False)
        self.torch_io = TorchCheckpointIO()
        # DCP loads in place: the model and optimizer exist (memory touched) before it runs.
        opt = ckpt["optimizer_states"][0]
        self.dcp_template = {"state_dict": {k: torch.zeros_like(v) for k, v in ckpt["state_dict"].items()},
                             "optimizer_states": [{"param_groups": opt["param_groups"], "state": {
                                 i: {n: torch.zeros_like(t) for n, t in s.items()} for i, s in opt["state"].items()}}]}  # fmt: skip

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
    "ours_verify": ("ours, load_checkpoint (verify_on_load=True)", "CRC32C of every byte read, one pass"),
    "ours_noverify": ("ours, load_checkpoint (verify_on_load=False)", "sizes only"),
    "torch_io": ("Lightning TorchCheckpointIO.load_checkpoint", "torch.load of one .ckpt"),
    "torch_load": ("torch.load(weights_only=True)", "same .ckpt"),
    "dcp": ("DCP load into preallocated tensors", "dcp.save'd copy of the same state"),
}


def bench_loads(args: argparse.Namespace, root: str, ckpt: dict[str, Any]) -> tuple[str, dict[str, float]]:
    loads = Loads(root, ckpt)
    runners: dict[str, Callable[[], Any]] = {"floor_read": loads.floor_read, "ours_verify": loads.ours_verify,
                                             "ours_noverify": loads.ours_noverify, "torch_io": loads.torch_io_load,
                                             "torch_load": loads.torch_load, "dcp": loads.dcp_load}  # fmt: skip
    methods = [m for m in runners if getattr(args, "methods", None) is None or m in args.methods]
    caches = ["warm", "cold"] if not args.no_cold else ["warm"]
    results: dict[tuple[str, str], list[float]] = {(c, m): [] for c in caches for m in methods}
    for rnd in range(args.repeats + 1):
        for cache in caches:
            order = methods[rnd % len(methods) :] + methods[: rnd % len(methods)]
            for m in order:
                (evict if cache == "cold" else warm)(loads.files(m))
                gc.collect()
                t0 = time.perf_counter()
                out = runners[m]()
                dt = time.perf_counter() - t0
                if rnd == 0 and out is not None and not same(ckpt, out):
                    raise SystemExit(f"{m} loaded different tensors")
                del out
                if rnd > 0:
                    results[(cache, m)].append(dt)
    total = sum(os.path.getsize(p) for p in files_under(loads.ours_dir))
    rows = []
    for cache in caches:
        for m in methods:
            label, note = LOAD_METHODS[m]
            xs = results[(cache, m)]
            rows.append([cache, label, fmt_s(median(xs)), fmt_range(xs), f"{total / median(xs) / 1e9:.2f}", note])

    def ratio(cache: str, a: str, b: str) -> float:
        return paired(results[(cache, a)], results[(cache, b)])

    pairs = [("ours_verify", "floor_read"), ("ours_noverify", "floor_read"), ("ours_verify", "torch_load"),
             ("ours_verify", "torch_io"), ("ours_verify", "dcp")]  # fmt: skip
    figures = {f"{c} {a}/{b}": ratio(c, a, b) for c in caches for a, b in pairs if a in methods and b in methods}
    return "\n".join([f"#### (a) resume, 1 process: {nbytes(ckpt) / MiB:.0f} MiB state in {len(tensors_of(ckpt))} "
                      f"tensors ({total / MiB:.0f} MiB of files), {args.repeats} measured rounds after 1 warm-up "
                      "(median, min-max)", "", table(["cache", "method", "load (s)", "range", "GB/s", "notes"], rows),
                      ""]), figures  # fmt: skip


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
        ["FLOOR: copy into preallocated, touched buffers", fmt_s(median(floors)), fmt_range(floors), "1.00", "floor"],
        row("ours, first save, no preparation", "none", "buffers allocated inside the save"),
        row("ours, first save after prepare_staging", "done", f"background preparation took "
            f"{fmt_s(median(results['prepare_done']))} s, off the training thread"),
        row("ours, first save while prepare_staging still runs", "racing",
            "signal right after on_train_start: waits for the preparation"),
        row("ours, steady-state save", "steady", "second save, buffers reused"),
    ]  # fmt: skip
    text = "\n".join([f"#### (c) first-save stall, 1 process: {nbytes(ckpt) / MiB:.0f} MiB, {args.repeats} rounds "
                      "after 1 warm-up", "", table(["save", "blocks (s)", "range", "/ floor", "notes"], rows), ""])  # fmt: skip
    return text, {"first/floor": ratio_to_floor("none"), "prepared first/floor": ratio_to_floor("done"),
                  "steady/floor": ratio_to_floor("steady")}  # fmt: skip


# ---- (b) + (c) N ranks ---------------------------------------------------------------------
def _rank_worker(rank: int, world: int, root: str, size_mib: int, n_tensors: int, repeats: int, cold: bool) -> None:
    import torch.distributed as dist
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_preempt import ShardedAsyncCheckpointIO
    from lightning_preempt.collective.groups import new_gloo_group

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


def bench_ranks(args: argparse.Namespace, root: str, world: int) -> tuple[str, dict[str, float]]:
    sub = os.path.join(root, f"ranks{world}")
    os.makedirs(sub)
    spawn_gloo(_rank_worker, world, sub, args.size_mib, args.tensors, args.repeats, not args.no_cold)
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
        return paired(times[f"{cache} {a}"], times[f"{cache} {b}"])

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


#: ratio name -> (figure key, target; None: information only)
CHECKS = {
    "warm: ours (verify) / read floor": ("warm ours_verify/floor_read", 1.5),
    "cold: ours (verify) / read floor": ("cold ours_verify/floor_read", 1.5),
    "warm: ours (verify) / torch.load": ("warm ours_verify/torch_load", 1.0),
    "cold: ours (verify) / torch.load": ("cold ours_verify/torch_load", 1.0),
    "warm: ours (verify) / TorchCheckpointIO": ("warm ours_verify/torch_io", 1.0),
    "warm: ours (no verify) / read floor": ("warm ours_noverify/floor_read", None),
    "warm: ours (verify) / DCP load": ("warm ours_verify/dcp", None),
    "first save, no preparation / copy floor": ("first/floor", None),
    "first save after prepare_staging / copy floor": ("prepared first/floor", 1.2),
    "steady-state save / copy floor": ("steady/floor", 1.0),
}


def run_one(args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    started, machine = time.perf_counter(), machine_notes()
    parts: list[str] = []
    figures: dict[str, float] = {}
    with workdir(args.dir, "lp-bench-resume-") as root:
        ckpt = lightning_style_checkpoint(args.size_mib * MiB, args.tensors)
        for part, bench in (("a", bench_loads), ("c", bench_first_save)):
            if part in args.parts:
                d = os.path.join(root, part)
                os.makedirs(d)
                text, f = bench(args, d, ckpt)
                parts.append(text)
                figures |= f
                shutil.rmtree(d, ignore_errors=True)
        del ckpt
        gc.collect()
        for world in _worlds(args) if "b" in args.parts else []:
            text, f = bench_ranks(args, root, world)
            parts.append(text)
            figures |= f
    checks = {name: (figures[key], t) for name, (key, t) in CHECKS.items() if key in figures}
    for world in _worlds(args):
        for c in ("warm", "cold"):
            for floor, key, t in (("read floor", "floor_read", 1.5), ("TorchCheckpointIO", "torch_io", 1.2)):
                if (k := f"{world} ranks {c} ours_verify/{key}") in figures:
                    checks[f"{world} ranks {c}: ours (verify) / {floor}"] = (figures[k], t)
        if (k := f"{world} ranks staged share") in figures:
            checks[f"{world} ranks: largest rank's staged bytes / state"] = (figures[k], 1.2 / world)
    head = [f"### bench_resume ({args.size_mib} MiB, {args.tensors} tensors)", "",
            f"Machine: {machine}; run took {time.perf_counter() - started:.0f}s", ""]  # fmt: skip
    info = [f"- {name}: {v:.2f} (information)" for name, (v, t) in checks.items() if t is None]
    judged = ratio_table((name, v, t, False) for name, (v, t) in checks.items() if t is not None)
    return "\n".join(head + parts + judged + info), {name: v for name, (v, _) in checks.items()}


def _worlds(args: argparse.Namespace) -> list[int]:
    return [int(w) for w in str(args.ranks).split(",") if w.strip() and int(w) > 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: a fresh dir under /tmp, removed after)")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--tensors", default="24", help="tensor count, or a comma list for the curve (e.g. 24,400,4000)")
    p.add_argument("--ranks", default="2,4", help="rank counts for (b), comma list (default 2,4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", default="abc", help="a (1-process loads), b (N ranks), c (first save); default abc")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache rounds")
    p.add_argument("--methods", type=lambda v: v.split(","), default=None,
                   help=f"(a) only these load methods, comma list of {','.join(LOAD_METHODS)} (default: all)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 16 tensors, 2 rounds, 2 ranks")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.tensors, args.repeats, args.ranks = 128, "16", 2, "2"
    counts = [int(n) for n in str(args.tensors).split(",")]
    curve: dict[int, dict[str, float]] = {}
    for n in counts:
        text, curve[n] = run_one(argparse.Namespace(**{**vars(args), "tensors": n}))
        print(text + "\n", flush=True)
    if len(counts) > 1:
        keys = list(dict.fromkeys(k for n in counts for k in curve[n]))
        rows = [[k, *(f"{curve[n][k]:.2f}" if k in curve[n] else "—" for n in counts)] for k in keys]
        print(f"### The curve: {args.size_mib} MiB in {', '.join(map(str, counts))} tensors (median of per-round "
              f"ratios; each column is one run above)\n\n" + table(["ratio", *(f"{n} tensors" for n in counts)], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
