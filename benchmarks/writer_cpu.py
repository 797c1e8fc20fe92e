"""CPU seconds a save costs the background threads, by phase, inside a real ``Trainer.fit``
(issue 33: on a host whose cores the step uses, the writer's CPU is what a save steals).

The fit of bench_fit_overhead.py (the same model, 24 or 4000 tensors, 50 ms steps) with ours
(``PreemptionCallback`` + ``ShardedAsyncCheckpointIO``) saving every step, 1 and 2 ranks. Every
job of the writer thread is timed with ``time.thread_time`` (the thread's own CPU), and inside
a save job each phase exclusively (a phase's time excludes the phases nested in it): the write
decision, DCP's planning, the shard records (serialisation and buffered writes), CRC32C, the
data syncs, ``.metadata``, the skeleton, the collectives, the manifest, retention, the ledger.
Beside them every thread's CPU from ``/proc/self/task`` over the timed window, and the
process's CPU a step against the same fit without checkpointing.

    python benchmarks/writer_cpu.py                        # 1 and 2 ranks, 24 and 4000 tensors
    python benchmarks/writer_cpu.py --ranks 2 --tensors 4000 --profile 25   # + cProfile's top 25
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import free_port, median, table

WRITER = "lightning_preempt-writer"
_stack = threading.local()


class Phases:
    """Exclusive CPU seconds per phase on the writer thread (``time.thread_time``)."""

    def __init__(self) -> None:
        self.totals: collections.Counter[str] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if threading.current_thread().name != WRITER:
            yield
            return
        stack: list[list[Any]] = getattr(_stack, "s", None) or []
        _stack.s = stack
        now = time.thread_time()
        if stack:
            stack[-1][1] += now - stack[-1][2]  # the parent's time so far
        stack.append([name, 0.0, now])
        try:
            yield
        finally:
            now = time.thread_time()
            frame = stack.pop()
            with self.lock:
                self.totals[name] += frame[1] + now - frame[2]
                self.counts[name] += 1
            if stack:
                stack[-1][2] = now

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)


def instrument(phases: Phases) -> None:
    """Wrap the phases of a save where the writer looks them up (module attributes)."""
    import os as _os

    import torch.distributed as dist

    from lightning_preempt.catalog import retention, verified
    from lightning_preempt.collective import agree
    from lightning_preempt.engine import ledger_writer
    from lightning_preempt.format import manifest
    from lightning_preempt.save import saver
    from lightning_preempt.storage import checksum, local
    from lightning_preempt.write import commit, dcp_writer, planning

    w = phases.wrap
    w(commit, "plan_write", "write decision")
    w(commit, "finish_write", "finish_write (old files)")
    w(commit, "dcp_save_tensors", "dcp.save (rest)")
    for method in ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan"):
        w(planning.CachingSavePlanner, method, "planning")
    w(dcp_writer.ChecksummingWriter, "write_data", "shard records (rest)")
    w(dcp_writer.ChecksummingWriter, "finish", ".metadata")
    w(dcp_writer, "replay_file", "shard records (replay)")
    w(checksum.Crc32c, "update", "crc32c")
    w(local, "sync_data", "data syncs (fdatasync)")
    w(local, "write_atomic", "manifest write (atomic)")
    w(_os, "fsync", "fsync")
    w(manifest.Manifest, "to_json", "manifest json")
    for name in ("gather", "decide", "agree"):
        w(agree, name, f"agree.{name} (collective)")
    for name in ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object",
                 "all_reduce", "broadcast", "barrier", "gather", "all_gather", "scatter"):  # fmt: skip
        if hasattr(dist, name):
            w(dist, name, f"torch.distributed.{name}")
    from lightning_preempt.engine import engine as engine_module

    w(engine_module, "retain", "retention (rest)")
    w(retention, "list_checkpoints", "retention: listing")
    w(retention, "check_checkpoint", "retention: checking sizes/CRCs")
    w(retention, "remove_if_ours", "retention: removing")
    w(retention, "prune_ledgers", "retention: ledgers")
    w(verified, "mark_verified", "mark_verified")
    w(ledger_writer.Ledger, "add", "ledger add")
    w(saver.Saver, "_write", "save job (rest)")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by its Python name (threads Python
    did not start: ``native``), summed over equal names."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: collections.Counter[str] = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "training (main)" if int(tid) == main else names.get(int(tid), "native (gloo, OpenMP...)")
        name = name.split("_", 1)[0] if name.startswith("lp-write") else name
        out[name.rstrip("0123456789-")] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def make_window(warm: int, steps: int, snaps: dict[str, Any], phases: Phases, per_job: list[tuple[str, float]],
                capture: list[bool]) -> Any:  # fmt: skip
    """A callback opening the window at step ``warm`` (counters cleared, CPU snapshot) and
    closing it ``steps`` steps later (snapshot, the phases and jobs so far)."""
    import lightning as L

    class Window(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            if trainer.global_step == warm:
                phases.totals.clear()
                phases.counts.clear()
                per_job.clear()
                capture[0] = True
                snaps["t0"] = (time.perf_counter(), time.process_time(), thread_cpu())
            elif trainer.global_step == warm + steps:
                snaps["t1"] = (time.perf_counter(), time.process_time(), thread_cpu())
                capture[0] = False
                snaps["phases"] = dict(phases.totals)
                snaps["counts"] = dict(phases.counts)
                snaps["jobs"] = list(per_job)

    return Window()


def worker(args: argparse.Namespace) -> int:
    import logging
    import warnings

    import lightning as L
    import torch
    import torch.distributed as dist
    from bench_fit_overhead import Batches, build
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO
    from lightning_preempt.write import jobs

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("lightning_preempt").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    world = args.world
    if world > 1:
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    phases = Phases()
    instrument(phases)
    per_job: list[tuple[str, float]] = []
    profiler = cProfile.Profile() if args.profile else None
    submit = jobs.JobQueue.submit

    def timed_submit(self: Any, job: Callable[[], Any]) -> Any:
        kind = getattr(job, "__qualname__", "job")

        def run() -> Any:
            t0 = time.thread_time()
            if profiler is not None and capture[0]:
                profiler.enable()
            try:
                with phases.phase("job (rest)"):
                    return job()
            finally:
                if profiler is not None and capture[0]:
                    profiler.disable()
                per_job.append((kind, time.thread_time() - t0))

        return submit(self, run)

    jobs.JobQueue.submit = timed_submit  # type: ignore[method-assign]
    capture = [False]
    result: dict[str, Any] = {}
    for method in ("none", "ours"):
        warm, steps = 3, args.saves
        snaps: dict[str, Any] = {}
        window = make_window(warm, steps, snaps, phases, per_job, capture)

        root = tempfile.mkdtemp(prefix="lp-wcpu-", dir=args.root)
        callbacks: list[Any] = [window]
        plugins: list[Any] = []
        if method == "ours":
            callbacks.append(PreemptionCallback(root, every_n_train_steps=1, keep_last_n=2))
            plugins.append(ShardedAsyncCheckpointIO())
        trainer = L.Trainer(
            max_steps=warm + steps + 1, accelerator="cpu", devices=world,
            strategy=DDPStrategy(broadcast_buffers=False) if world > 1 else "auto",
            callbacks=callbacks, plugins=plugins or None, enable_checkpointing=False, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(build(args.width, args.tensors, args.step_ms), Batches(args.width, 16, "cpu"))
        (w0, p0, th0), (w1, p1, th1) = snaps["t0"], snaps["t1"]
        threads = {k: th1.get(k, 0.0) - th0.get(k, 0.0) for k in th1}
        result[method] = {"wall": w1 - w0, "proc": p1 - p0, "threads": threads, "phases": snaps["phases"], "counts": snaps["counts"],
                          "jobs": snaps["jobs"], "steps": steps}  # fmt: skip
    if profiler is not None and rank == 0:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(args.profile)
        result["profile"] = buf.getvalue()
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(args.profile)
        result["profile_cum"] = buf.getvalue()
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump(result, f)
    return 0


def run_world(world: int, tensors: int, args: argparse.Namespace, root: str) -> list[dict[str, Any]]:
    out = os.path.join(root, f"wcpu-{world}-{tensors}.json")
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "GROUP_RANK": "0"}  # fmt: skip
        if world == 1:
            for name in ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
                env.pop(name)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--world", str(world), "--out", out,
               "--root", root, "--tensors", str(tensors), "--saves", str(args.saves), "--width", str(args.width),
               "--step-ms", str(args.step_ms), "--profile", str(args.profile)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"writer_cpu: a {world}-rank worker failed (exit codes {codes})")
    results = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            results.append(json.load(f))
    return results


def report(world: int, tensors: int, results: list[dict[str, Any]], profile: int) -> str:
    lines = [f"#### {world} rank(s), {tensors} tensors, a save every step ({results[0]['ours']['steps']} timed saves)"]
    rows = []
    for rank, res in enumerate(results):
        ours, none = res["ours"], res["none"]
        n = ours["steps"]
        by_kind: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        for kind, cpu in ours["jobs"]:
            by_kind[kind].append(cpu)
        for kind, cpus in sorted(by_kind.items()):
            rows.append([str(rank), f"job {kind}", f"{1e3 * sum(cpus) / n:.1f}", f"{len(cpus)}",
                         f"{1e3 * median(cpus):.1f}"])  # fmt: skip
        for name, cpu in sorted(ours["phases"].items(), key=lambda kv: -kv[1]):
            calls = ours.get("counts", {}).get(name, 0)
            rows.append([str(rank), f"  phase: {name}", f"{1e3 * cpu / n:.1f}", f"{calls / n:.1f} a save", ""])
        for name in sorted(set(ours["threads"]) | set(none["threads"])):
            a, b = ours["threads"].get(name, 0.0), none["threads"].get(name, 0.0)
            if a or b:
                rows.append(
                    [str(rank), f"thread {name} (ours - none)", f"{1e3 * (a / n - b / none['steps']):.1f}", "", ""]
                )
        extra_cpu = ours["proc"] / n - none["proc"] / none["steps"]
        rows.append([str(rank), "process CPU a step: ours - none", f"{1e3 * extra_cpu:.1f}", "", ""])
        slower = (ours["wall"] / n) / (none["wall"] / none["steps"])
        rows.append([str(rank), "wall a step: ours / none", f"{slower:.2f}x", "", ""])
    lines += ["", table(["rank", "what", "CPU ms a save", "calls", "median ms a call"], rows)]
    if profile and "profile" in results[0]:
        lines += ["", "```", results[0]["profile"][-6000:], "```", "", "```", results[0]["profile_cum"][-6000:], "```"]
    return "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=ints, default=[1, 2])
    p.add_argument("--tensors", type=str, default="24,4000")
    p.add_argument("--saves", type=int, default=20, help="timed saves a fit (default 20)")
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--profile", type=int, default=0, help="print cProfile's top N of the writer thread (rank 0)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.tensors = int(args.tensors)
        return worker(args)
    print(f"`uptime` before: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="lp-wcpu-") as root:
        for world in args.ranks:
            for tensors in ints(args.tensors):
                print(report(world, tensors, run_world(world, tensors, args, root), args.profile), flush=True)
                print(flush=True)
    print(f"`uptime` after: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
