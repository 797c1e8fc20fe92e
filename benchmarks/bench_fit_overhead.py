"""The cost of checkpointing in a whole ``Trainer.fit``: steps per second against the same fit
without checkpointing (issue 33).

The same small model and data (a step of a few ms plus ``--step-ms`` of sleep standing for the
accelerator's time), the same ``Trainer``, these ways to checkpoint:

* (a) no checkpointing (``enable_checkpointing=False``): the baseline;
* (b) ``ModelCheckpoint(every_n_train_steps=N, save_top_k=1)`` with ``TorchCheckpointIO``;
* (c) the same ``ModelCheckpoint`` with ``AsyncCheckpointIO``;
* (d) DCP ``async_save`` of ``{"model", "optim"}`` from a callback every N steps, at most one
  save in flight (torchtitan's way), on a gloo group of its own under DDP;
* (e) ours: ``PreemptionCallback(every_n_train_steps=N)`` + ``ShardedAsyncCheckpointIO``
  ((e') ``overlap_staging=True``, on CUDA);
* (f) the floor of any save through Lightning: its checkpoint dict (``dump_checkpoint``) built
  every N steps and dropped.

Rows: save intervals 1, 10, 100 steps; 24 tensors (6 ``Linear`` layers + SGD momentum) and 4000
tensors (the same layers + 3976 small buffers); 1 and 2 ranks (real DDP over gloo, each rank a
process started here with Lightning's environment variables). Each fit's first save (and the
agreement's calibration steps) is untimed; then at least ``--steps`` steps and ``--saves`` saves
are timed (a window that would pass ``--window-s`` stops after one interval). The rows of one
world are interleaved, their order reversed every other round. Overhead = median over rounds of
(baseline rate / row rate - 1).

    python benchmarks/bench_fit_overhead.py              # the whole table, 1 round
    python benchmarks/bench_fit_overhead.py --full       # 3 rounds, 40-step windows, 3 saves
    python benchmarks/bench_fit_overhead.py --quick      # tiny sizes, 1 round: the code paths
    python benchmarks/bench_fit_overhead.py --device cuda   # on a GPU (2 ranks need 2 GPUs)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import MiB, fmt_range, machine_notes, median, spawn_ranks, table

METHODS = ("none", "torch_io", "async_io", "dcp_async", "ours", "ours_overlap", "dict_only")
LABELS = {
    "none": "(a) no checkpointing",
    "torch_io": "(b) ModelCheckpoint + TorchCheckpointIO",
    "async_io": "(c) ModelCheckpoint + AsyncCheckpointIO",
    "dcp_async": "(d) DCP async_save, hand-written callback",
    "ours": "(e) ours: PreemptionCallback + ShardedAsyncCheckpointIO",
    "ours_overlap": "(e') ours, overlap_staging=True",
    "dict_only": "(f) floor: Lightning's checkpoint dict alone, nothing stored",
}
N_LAYERS = 6  # Linear layers with bias: 12 parameters, 24 tensors with SGD's momentum
BATCH, THREADS = 16, 1  # a rank's batch; torch intra-op threads a rank (torchrun's default)
MAX_WINDOW, WINDOW_S = 100, 4.0  # timed steps a fit once it holds a save; seconds before a window closes early


# ---------------------------------------------------------------- one fit (runs in a worker)
def build(width: int, n_tensors: int, step_ms: float = 0.0) -> Any:
    """``N_LAYERS`` Linear layers plus small buffers up to ``n_tensors`` tensors of state; each
    step sleeps ``step_ms`` (the host idling while an accelerator computes: it frees the cores)."""
    import time as _time

    import lightning as L
    import torch

    n_small = max(0, n_tensors - 4 * N_LAYERS)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(N_LAYERS))
            # Buffers, not parameters: 2000 parameters would make a CPU step 10x longer in
            # autograd's bookkeeping; a save handles a buffer as any other tensor.
            for i in range(n_small):
                self.register_buffer(f"small_{i}", torch.zeros(64))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x = batch
            for layer in self.layers:
                x = torch.relu(layer(x))
            if step_ms > 0:
                _time.sleep(step_ms / 1e3)
            return x.square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-4, momentum=0.9, foreach=True)

    return Net()


class Batches:
    """An endless loader of one batch (no I/O: the step is the model's time alone)."""

    def __init__(self, width: int, batch: int, device: str) -> None:
        import torch

        self.x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0)).to(device)

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.x


def clock(warm_until: int, steps: int, least: int, window_s: float, warm_save: Any = None) -> Any:
    """A callback timing ``steps`` steps from ``on_train_batch_start`` of step ``warm_until + 1``
    to that of the step after them (every hook of the last step, saves included, inside). A
    window that would pass ``window_s`` at the pace of its first ``least`` steps closes there
    (every rank alike: one reduce at step ``least``). ``warm_save``: one untimed save after step 1."""
    import time as _time

    import lightning as L

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0
            self.timed = steps

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            done = trainer.global_step - warm_until
            if done == 0:
                self.t0 = _time.perf_counter()
            elif self.t1 == 0.0 and done > 0 and (done == steps or (done == least and self._long(trainer))):
                self.t1, self.timed = _time.perf_counter(), done
                trainer.should_stop = True

        def _long(self, trainer: L.Trainer) -> bool:
            over = (_time.perf_counter() - self.t0) * steps / least > window_s
            return bool(trainer.strategy.reduce_boolean_decision(over, all=False))

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if warm_save is not None and trainer.global_step == 1:
                warm_save(trainer, pl_module)

    return Clock()


def dcp_callback(dirpath: str, every: int, group: Any) -> Any:
    """(d): DCP ``async_save`` every ``every`` steps from a callback, one save in flight."""
    import lightning as L
    import torch.distributed.checkpoint as dcp

    class DcpAsyncSave(L.Callback):
        def __init__(self) -> None:
            self.pending: Any = None
            self.dirs: list[str] = []

        def _wait(self) -> None:
            if self.pending is not None:
                self.pending.result()
                self.pending = None

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step % every == 0:
                self.save(trainer, pl_module, os.path.join(dirpath, f"step-{trainer.global_step}"))

        def save(self, trainer: L.Trainer, pl_module: L.LightningModule, path: str) -> None:
            self._wait()  # at most one in flight: the next save waits for the previous one
            if len(self.dirs) >= 2 and trainer.is_global_zero:  # keep the last two, like ours
                shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
            self.dirs.append(path)
            state = {"model": pl_module.state_dict(), "optim": trainer.optimizers[0].state_dict()}
            self.pending = dcp.async_save(state, checkpoint_id=path, process_group=group)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self._wait()

    return DcpAsyncSave()


def dict_callback(every: int) -> Any:
    """(f): Lightning's checkpoint dict every ``every`` steps, built as ``Trainer.save_checkpoint``
    builds it for any ``CheckpointIO``, and dropped: what every Lightning save pays before storing."""
    import lightning as L

    class CheckpointDict(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step % every == 0:
                self.build(trainer)

        def build(self, trainer: L.Trainer) -> None:
            trainer._checkpoint_connector.dump_checkpoint(weights_only=False)

    return CheckpointDict()


def warm_up(every: int) -> int:
    """Untimed steps of a fit: its first save, and from 10 steps on the agreement's calibration."""
    from lightning_preempt.preemption.schedule import CALIBRATION_STEPS

    return 2 if every == 1 else CALIBRATION_STEPS + 1


def window(every: int, args: argparse.Namespace) -> int:
    """Timed steps of a fit saving every ``every`` steps: ``--steps``, at least ``--saves`` saves,
    at most ``MAX_WINDOW`` steps once it holds one save."""
    if not every:
        return int(args.steps)
    return int(max(args.steps, min(args.saves * every, max(every, MAX_WINDOW))))


_FITS = itertools.count()  # the fits this process ran: the same sequence on every rank


def one_fit(method: str, every: int, args: argparse.Namespace, n_tensors: int, root: str, group: Any) -> float:
    """Steps per second of one fit's timed window."""
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning

    warm_until = warm_up(every)
    steps = window(every, args) if method != "none" else max(window(e, args) for e in args.every)
    # One path on every rank: each rank's process runs the same fits in the same order, so the
    # fit's number is the same there (a clock read per rank gave each rank its own dirpath, and
    # rank 0's manifests listed a shard written elsewhere: issue 55).
    dirpath = os.path.join(root, f"{method}-{every}-{n_tensors}-{next(_FITS)}")
    least = max(3, min(every, steps)) if every else steps  # one save interval (3 steps at least)
    warm_path = os.path.join(f"{dirpath}-warm", "warm.ckpt")
    callbacks: list[Any] = []
    plugins: list[Any] = []
    warm_save: Any = lambda trainer, _: trainer.save_checkpoint(warm_path)  # noqa: E731
    if method in ("torch_io", "async_io"):
        callbacks.append(ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=1))
        if method == "async_io":
            plugins.append(AsyncCheckpointIO())
    elif method == "dcp_async":
        callbacks.append(dcp := dcp_callback(dirpath, every, group))
        warm_save = lambda trainer, module: dcp.save(trainer, module, warm_path)  # noqa: E731
    elif method == "dict_only":
        callbacks.append(dump := dict_callback(every))
        warm_save = lambda trainer, _: dump.build(trainer)  # noqa: E731
    elif method in ("ours", "ours_overlap"):
        callbacks.append(PreemptionCallback(dirpath, every_n_train_steps=every, keep_last_n=2))
        plugins.append(ShardedAsyncCheckpointIO(tuning=Tuning(overlap_staging=method == "ours_overlap")))
    probe = clock(warm_until, steps, least, WINDOW_S, warm_save if method != "none" and every > 1 else None)
    callbacks.insert(0, probe)
    # (buffers never change here: no broadcast of 3976 of them every step)
    strategy = DDPStrategy(broadcast_buffers=False) if args.world > 1 else "auto"
    trainer = L.Trainer(max_steps=warm_until + steps + 1, accelerator="gpu" if args.device == "cuda" else "cpu",
                        devices=args.world, strategy=strategy, callbacks=callbacks, plugins=plugins or None,
                        enable_checkpointing=method in ("torch_io", "async_io"), logger=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the dataloader has no __len__", "few workers": same for every row
        trainer.fit(build(args.width, n_tensors, args.step_ms), Batches(args.width, BATCH, args.device))
    if trainer.is_global_zero:
        shutil.rmtree(dirpath, ignore_errors=True)
        shutil.rmtree(f"{dirpath}-warm", ignore_errors=True)
    return probe.timed / (probe.t1 - probe.t0)


def rows_of(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(method, interval, tensors) of every fit in one round; the baseline once per tensor count."""
    out: list[tuple[str, int, int]] = []
    for n in args.tensors:
        out.append(("none", 0, n))
        out += [(m, every, n) for every in args.every for m in args.methods[1:]]
    return out



def copy_floor(width: int, n_tensors: int, device: str, repeats: int = 7) -> float:
    """Seconds to copy the fit's state (parameters and SGD momentum, as many tensors) into
    preallocated, touched buffers with one ``_foreach_copy_``: the blocking floor of a save.
    Caches are flushed before each copy (64 MiB written): in a fit the step and the writer
    evict the state between two saves, and a state of a few MiB copied in a hot loop would
    stay in the cache and set a floor no save can meet. On CUDA: device to pinned host
    buffers, synchronized (what the stager does there). ``sources``: the tensors to copy
    (a fit's own, where they lie in memory); default those of a new model of the fit's shape."""
    import torch

    cuda = device == "cuda"
    model = build(width, n_tensors).to(device)
    params = [p.detach() for p in model.parameters()]
    sources = [*params, *params, *model.buffers()]  # + one momentum buffer each
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in sources]
    torch._foreach_copy_(buffers, sources, non_blocking=cuda)  # touched
    scratch = torch.empty(16 << 20, dtype=torch.float32)
    times = []
    for i in range(repeats):
        scratch.fill_(float(i))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch._foreach_copy_(buffers, sources, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return median(times)



def worker(args: argparse.Namespace) -> int:
    """One rank of a world: every fit of every round, in the same interleaved order on each rank."""
    import logging

    import torch
    import torch.distributed as dist

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("lightning_preempt").setLevel(logging.WARNING)
    # torchrun's default (OMP_NUM_THREADS=1 a rank): 2 intra-op threads on a machine whose
    # cores are busy spin in OpenMP's barriers, and a 3 ms step took 5-300 ms from fit to fit.
    torch.set_num_threads(THREADS)
    group = None
    if args.world > 1:
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)  # Lightning's DDP finds it initialised and uses it
        group = dist.new_group(backend="gloo")  # DCP's background collectives stay off DDP's group
    rank = int(os.environ.get("RANK", "0"))
    root = os.path.join(args.root, f"world{args.world}")
    results: dict[str, Any] = {"rates": {}, "floor": {}}
    rows = rows_of(args)
    started = time.perf_counter()
    for n in args.tensors:  # a process's first fit pays one-time costs (lazy imports, first touches)
        one_fit("none", 1, argparse.Namespace(**{**vars(args), "steps": 3, "every": [0]}), n, root, group)
    for rnd in range(args.rounds):
        for method, every, n in rows if rnd % 2 == 0 else list(reversed(rows)):
            t0 = time.perf_counter()
            rate = one_fit(method, every, args, n, root, group)
            key = f"{method}|{every}|{n}"
            results["rates"].setdefault(key, []).append(rate)
            if rank == 0:
                print(f"bench_fit_overhead: {args.world} rank(s) round {rnd + 1}/{args.rounds} {key}: "
                      f"{rate:.1f} steps/s, fit {time.perf_counter() - t0:.1f}s, "
                      f"total {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)  # fmt: skip
        for n in args.tensors:  # once a round, between the fits (same process, same memory state)
            results["floor"].setdefault(str(n), []).append(copy_floor(args.width, n, args.device))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0



# ---------------------------------------------------------------- the parent
def run_world(world: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Start ``world`` ranks (Lightning's environment variables: it launches none itself); each
    reads the run's arguments from a file and rank 0 writes the results."""
    cfg, out = os.path.join(root, f"args-{world}.json"), os.path.join(root, f"results-{world}.json")
    with open(cfg, "w") as f:
        json.dump({**vars(args), "world": world, "out": out, "root": root}, f)
    # Lightning's banner lines ("GPU available", tips) go to the workers' stdout: dropped
    codes = spawn_ranks([sys.executable, os.path.abspath(__file__), "--worker", cfg], world)
    if any(codes):
        raise SystemExit(f"bench_fit_overhead: a {world}-rank worker failed (exit codes {codes})")
    with open(out) as f:
        return dict(json.load(f))


def report(results: dict[int, dict[str, Any]], args: argparse.Namespace, took: float, load: tuple[str, str]) -> str:
    rows, verdicts, overlap_lines = [], [], []
    others = [m for m in args.methods if m in ("torch_io", "async_io", "dcp_async")]
    ours = [m for m in args.methods if m.startswith("ours")]
    for world, res in results.items():
        rates = res["rates"]
        for n in args.tensors:
            base = rates[f"none|0|{n}"]
            rows.append([str(world), str(n), "—", LABELS["none"], f"{median(base):.1f}", fmt_range(base), "—"])
            floor = median(res["floor"][str(n)])
            for every in args.every:
                over: dict[str, float] = {}
                for m in args.methods[1:]:
                    got = rates[f"{m}|{every}|{n}"]
                    over[m] = 100 * median([b / r - 1 for b, r in zip(base, got, strict=True)])
                    rows.append([str(world), str(n), str(every), LABELS[m], f"{median(got):.1f}",
                                 fmt_range(got), f"{over[m]:+.1f}%"])  # fmt: skip
                if "ours_overlap" in over and "ours" in over:  # decides staging/overlap.py's AUTO_ON_CUDA
                    better = "on is better" if over["ours_overlap"] < over["ours"] else "off is better or equal"
                    overlap_lines.append(f"- {world} rank(s), {n} tensors, every {every}: overlap_staging=True "
                                         f"{over['ours_overlap']:+.1f}% vs off {over['ours']:+.1f}%: {better}")  # fmt: skip
                target = {1: 10.0, 10: 2.0}.get(every)
                # the blocking floor of a save as overhead: a rank copies ~1/N of the state under DDP
                floor_pct = 100 * floor / world * median(base) / every
                for m in ours:
                    line = f"- {world} rank(s), {n} tensors, every {every}: {m} {over[m]:+.1f}%"
                    if target is not None:
                        line += f" (target <= {target:g}%: {'met' if over[m] <= target else 'MISSED'})"
                    line += f"; copy floor {1e3 * floor / world:.1f} ms a rank = {floor_pct:.1f}% of {every} step(s)"
                    if "dict_only" in over:  # what any save through Trainer.save_checkpoint pays before storing
                        least = over["dict_only"] + floor_pct
                        line += f"; Lightning's dict + copy floor {least:+.1f}%: ours {over[m] - least:+.1f} points above"
                    if others:
                        ahead = all(over[m] < over[o] for o in others)
                        line += f"; ahead of (b)-(d): {'yes' if ahead else 'NO'} (best other {min(over[o] for o in others):+.1f}%)"
                    verdicts.append(line)
    state_mib = 2 * N_LAYERS * (args.width * args.width + args.width) * 4 / MiB
    step = f"CPU forward/backward + {args.step_ms:g} ms sleep standing for accelerator time" if args.step_ms > 0 else "pure-CPU step"
    return "\n".join([
        f"### Whole-fit overhead: {N_LAYERS} Linear {args.width}x{args.width} + SGD momentum "
        f"(~{state_mib:.1f} MiB of state), batch {BATCH}, device {args.device}, step = {step}",
        "",
        f"{args.rounds} round(s); timed window a fit: max({args.steps} steps, {args.saves} saves). "
        f"Machine: {machine_notes()}; {THREADS} intra-op thread(s) a rank; run took {took:.0f}s",
        f"`uptime` before: {load[0]}; after: {load[1]}",
        "",
        table(["ranks", "tensors", "save every", "method", "steps/s (median)", "range", "overhead"], rows),
        "",
        "Overhead = median over rounds of (no-checkpointing rate / row rate - 1); targets for ours: "
        "<= 2% every 10 steps, <= 10% every step, ahead of (b)-(d) in every row.",
        "",
        *verdicts,
        *(["", f"The overlap switch (`AUTO_ON_CUDA` in staging/overlap.py; device {args.device}):", *overlap_lines]
          if overlap_lines else []),
    ])  # fmt: skip


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 round, 1 rank: the code paths")
    p.add_argument("--full", action="store_true", help="3 rounds of longer windows (--steps 40 --saves 3)")
    p.add_argument("--dry-run", action="store_true", help="--quick with every method (the overlap rows too)")
    p.add_argument("--width", type=int, default=384, help="Linear width (default 384: ~7 MiB of state)")
    p.add_argument("--step-ms", type=float, default=None,
                   help="accelerator-time emulation: each step sleeps this long after its CPU forward/backward "
                        "(default 50 on CPU, 0 on CUDA; 0: the pure-CPU step, the writer competing for its cores)")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps a fit, at least (default 10; --full 40)")
    p.add_argument("--saves", type=int, default=2, help="timed saves a fit, at least (default 2; --full 3)")
    p.add_argument("--rounds", type=int, default=1, help="rounds (default 1; --full 3)")
    p.add_argument("--every", type=ints, default=[1, 10, 100], help="save intervals (default 1,10,100)")
    p.add_argument("--tensors", type=ints, default=[24, 4000], help="tensor counts (default 24,4000)")
    p.add_argument("--ranks", type=ints, default=[1, 2], help="world sizes (default 1,2)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--methods", type=lambda t: t.split(","), default=None,
                   help=f"rows (default: all of {','.join(METHODS)}; ours_overlap only on CUDA)")  # fmt: skip
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank: the run's arguments in this file
    args = p.parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            return worker(argparse.Namespace(**json.load(f)))
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.step_ms is None:
        args.step_ms = 0.0 if args.device == "cuda" else 50.0
    if args.methods is None:
        # On CUDA ours runs twice, overlap_staging off and on: the row pair that decides
        # staging/overlap.py's AUTO_ON_CUDA (docs/staging.md). On CPU overlap is known to cost.
        cuda_rows = args.device == "cuda" or args.dry_run  # (the dry run: the CUDA table's rows)
        args.methods = [m for m in METHODS if m != "ours_overlap" or cuda_rows]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or args.methods[0] != "none":
        p.error(f"--methods: start with none, choose from {','.join(METHODS)} (got {','.join(args.methods)})")
    given = argv if argv is not None else sys.argv[1:]
    if args.full:
        for name, value in (("steps", 40), ("saves", 3), ("rounds", 3)):
            if f"--{name.replace('_', '-')}" not in given:
                setattr(args, name, value)
    if args.quick or args.dry_run:
        args.width, args.steps, args.saves, args.rounds = 32, 4, 2, 1
        args.every, args.tensors = [1, 2], [24, 100]
        if "--ranks" not in given:
            args.ranks = [1]
    if args.device == "cuda":
        import torch

        args.ranks = [w for w in args.ranks if w <= torch.cuda.device_count()]
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="lp-fit-overhead-")
    try:
        results = {world: run_world(world, args, root) for world in args.ranks}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(report(results, args, time.perf_counter() - started, (load, after)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

