"""The cost of checkpointing in a whole ``Trainer.fit``: steps per second against the same fit
without checkpointing (issue 33).

The same small model and data (a step of a few ms: the worst case, where a save weighs most),
the same ``Trainer``, five ways to checkpoint:

* (a) no checkpointing (``enable_checkpointing=False``): the baseline;
* (b) Lightning's ``ModelCheckpoint(every_n_train_steps=N, save_top_k=1)`` with the default
  ``TorchCheckpointIO`` (synchronous ``torch.save``);
* (c) the same ``ModelCheckpoint`` with ``AsyncCheckpointIO`` (clones, then ``torch.save`` on a thread);
* (d) DCP ``async_save`` of ``{"model", "optim"}`` from a hand-written callback every N steps, at
  most one save in flight (torchtitan's way), on a gloo group of its own under DDP;
* (e) ours: ``PreemptionCallback(every_n_train_steps=N)`` + ``ShardedAsyncCheckpointIO``;
* (f) the floor of any checkpoint taken through Lightning: ``Trainer.save_checkpoint``'s
  checkpoint dict (``dump_checkpoint``: every module's ``state_dict()``, the optimizer's, the
  loops', the callbacks' ``on_save_checkpoint``) built every N steps and dropped, nothing stored.
  (b), (c) and (e) build it on every save; (d) builds only the model's and optimizer's dicts.
* (g) (``--methods ...,dict_copy``; by default only on CUDA) the floor of any save that stages
  before it returns: (f)'s dict, then one ``_foreach_copy_`` of its tensors (a rank's ~1/N under
  DDP, by bytes) into buffers it reuses, nothing stored. Measured inside the fit, so it includes
  what the copy costs the steps after it (the caches it evicts), which (f) + the copy floor
  (an isolated copy, added in the verdicts) leaves out.

Rows: save intervals 1, 10, 100 steps; 24 tensors (6 ``Linear`` layers + SGD momentum) and
4000 tensors (the same layers + 3976 small buffers, about the same bytes); 1 and 2 ranks
(real DDP over gloo; each rank a process started here with Lightning's environment variables,
so one process runs every fit of its world). Each fit's first save is untimed (plans,
buffers, threads: every step, step 1's; else one warm-up save after step 1) and, at intervals
of 10 steps and more, the agreement's calibration steps too (``CALIBRATION_STEPS``: every step
while it times them); so is the baseline's, whose window is the longest of any row's. Then
``--steps``-many steps are timed (at least ``--saves`` saves, an every-100 row's window 100
steps with 1 save; a row that would pass ``--window-s`` stops after one interval, 3 steps at
least); the rows of one world are interleaved and their order
reversed every other round. The figure is the median over rounds; overhead = median over
rounds of (baseline rate / row rate - 1). Saves still in flight when the window closes are
not counted (they finish after training).

    python benchmarks/bench_fit_overhead.py              # the whole table, 1 round (time: docs/benchmarks.md)
    python benchmarks/bench_fit_overhead.py --full       # 3 rounds, 40-step windows, 3 saves (not timed: > 3x the default)
    python benchmarks/bench_fit_overhead.py --quick      # tiny sizes, 1 round: the code paths
    python benchmarks/bench_fit_overhead.py --device cuda   # on a GPU (2 ranks need 2 GPUs)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MiB, fmt_range, machine_notes, median, table

METHODS = ("none", "torch_io", "async_io", "dcp_async", "ours", "ours_overlap", "dict_only", "dict_copy")
LABELS = {
    "none": "(a) no checkpointing",
    "torch_io": "(b) ModelCheckpoint + TorchCheckpointIO",
    "async_io": "(c) ModelCheckpoint + AsyncCheckpointIO",
    "dcp_async": "(d) DCP async_save, hand-written callback",
    "ours": "(e) ours: PreemptionCallback + ShardedAsyncCheckpointIO",
    "ours_overlap": "(e') ours, overlap_staging=True",
    "dict_only": "(f) floor: Lightning's checkpoint dict alone, nothing stored",
    "dict_copy": "(g) floor: the dict and one copy of its tensors, nothing stored",
}
N_LAYERS = 6  # Linear layers with bias: 12 parameters, 24 tensors with SGD's momentum


# ---------------------------------------------------------------- one fit (runs in a worker)
def build(width: int, n_tensors: int, step_ms: float = 0.0) -> Any:
    """The LightningModule: ``N_LAYERS`` Linear layers, plus small buffers up to ``n_tensors``
    tensors of state (parameters, their SGD momentum, buffers). ``step_ms`` > 0: each
    training step also sleeps that long, standing for the accelerator's time (a GPU user's
    step: the host launches kernels and idles while the device computes; the sleep releases
    the GIL and the cores as a wait on CUDA does)."""
    import time as _time

    import lightning as L
    import torch

    n_small = max(0, n_tensors - 4 * N_LAYERS)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(N_LAYERS))
            # 4000 tensors at about the same bytes: the small ones are 64 floats each. Buffers,
            # not parameters: 2000 parameters would spend ~50 ms a step in autograd's and the
            # optimizer's per-tensor bookkeeping on a 2-core CPU (a step 10x longer, a run of
            # half an hour); a save handles a buffer as any other tensor of the state.
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
    to ``on_train_batch_start`` of the step after them, so every hook of the last timed step,
    the saves included, lies inside the window. A window that would last longer than
    ``window_s`` at the pace of its first ``least`` steps (one whole save interval or more)
    closes there and stops the fit: a row of a few seconds a step (DCP at 4000 tensors, every
    step) would take minutes. ``timed``: the
    steps in the window. Every rank decides alike: the ranks reduce "over time?" once, at
    step ``least`` (not every step: that would add a collective to the rows only).
    ``warm_save(trainer, module)``: the method's one untimed save after step 1 (its plans,
    buffers and threads built), so a fit saving every 100 steps needs no 100 warm-up steps."""
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


def dict_callback(every: int, copy_on: str | None = None) -> Any:
    """(f): Lightning's checkpoint dict every ``every`` steps, built as ``Trainer.save_checkpoint``
    builds it for any ``CheckpointIO`` and dropped: what every Lightning save pays before storing.
    (g), ``copy_on`` a device: then one copy of its tensors into buffers made at the first save
    and reused (pinned on CUDA, as a stager's); under DDP a rank copies its share (``replica_owners``)."""
    import lightning as L
    import torch

    from lightning_preempt.format.shares import replica_owners

    cuda = copy_on == "cuda"

    class CheckpointDict(L.Callback):
        def __init__(self) -> None:
            self.buffers: list[torch.Tensor] | None = None
            self.mine: list[int] = []

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step % every == 0:
                self.build(trainer)

        def build(self, trainer: L.Trainer) -> None:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            if copy_on is not None:
                self.copy(checkpoint, trainer.world_size, trainer.global_rank)

        def copy(self, checkpoint: dict[str, Any], world: int, rank: int) -> None:
            state = checkpoint["optimizer_states"][0]["state"]
            moments = (t for s in state.values() for t in s.values() if isinstance(t, torch.Tensor))
            tensors = [*checkpoint["state_dict"].values(), *moments]
            if self.buffers is None:  # the first (untimed) save: this rank's share (as ours splits it), its buffers
                owners = replica_owners({str(i): t for i, t in enumerate(tensors)}, world)
                self.mine = [i for i in range(len(tensors)) if owners[str(i)] == rank]
                self.buffers = [torch.empty(tensors[i].shape, dtype=tensors[i].dtype, pin_memory=cuda)
                                for i in self.mine]  # fmt: skip
            torch._foreach_copy_(self.buffers, [tensors[i] for i in self.mine], non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize()

    return CheckpointDict()


def warm_up(every: int) -> int:
    """Untimed steps of a fit: its first save done (every step: step 1's; else the warm-up
    save after step 1, :func:`clock`), and from 10 steps on also the agreement's calibration
    (an exchange every step while it times them; at every step the saves outweigh it, and 20
    saved warm-up steps would triple the fit). The baseline (``every == 0``) warms up alike."""
    from lightning_preempt.preemption.schedule import CALIBRATION_STEPS

    return 2 if every == 1 else CALIBRATION_STEPS + 1


def window(every: int, args: argparse.Namespace) -> int:
    """Timed steps of a fit saving every ``every`` steps: ``--steps``, and at least ``--saves``
    saves, but no more than ``--max-window`` steps once it holds one save (every 100 steps at
    50 ms a step: 100 timed steps, 1 save, not 200)."""
    if not every:
        return int(args.steps)
    return int(max(args.steps, min(args.saves * every, max(every, args.max_window))))


_FITS = itertools.count()  # the fits this process ran: the same sequence on every rank


def one_fit(
    method: str, every: int, args: argparse.Namespace, n_tensors: int, root: str, group: Any
) -> tuple[float, list[float], float | None]:
    """Steps per second of one fit's timed window, and (ours) each timed save's blocking
    time without its wait for the previous save (``Saver.history``) and the copy floor of the
    fit's own tensors after it (:func:`copy_floor`, where they lie in memory)."""
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

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
    elif method in ("dict_only", "dict_copy"):
        callbacks.append(dump := dict_callback(every, args.device if method == "dict_copy" else None))
        warm_save = lambda trainer, _: dump.build(trainer)  # noqa: E731
    elif method in ("ours", "ours_overlap"):
        callbacks.append(PreemptionCallback(dirpath, every_n_train_steps=every, keep_last_n=2))
        plugins.append(ShardedAsyncCheckpointIO(overlap_staging=method == "ours_overlap"))
    probe = clock(warm_until, steps, least, args.window_s, warm_save if method != "none" and every > 1 else None)
    callbacks.insert(0, probe)
    trainer = L.Trainer(
        max_steps=warm_until + steps + 1,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=args.world,
        # (buffers never change here: no broadcast of 3976 of them every step)
        strategy=DDPStrategy(broadcast_buffers=False) if args.world > 1 else "auto",
        callbacks=callbacks,
        plugins=plugins or None,
        enable_checkpointing=method in ("torch_io", "async_io"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the dataloader has no __len__", "few workers": same for every row
        trainer.fit(build(args.width, n_tensors, args.step_ms), Batches(args.width, args.batch, args.device))
    if trainer.is_global_zero:
        shutil.rmtree(dirpath, ignore_errors=True)
        shutil.rmtree(f"{dirpath}-warm", ignore_errors=True)
    blocked: list[float] = []
    own_floor = None
    if plugins and isinstance(plugins[0], ShardedAsyncCheckpointIO):
        blocked = [
            r.blocking_s - r.waited_s for r in plugins[0].saver.history if warm_until < r.step <= warm_until + probe.timed
        ]
        own_floor = copy_floor(args.width, n_tensors, args.device, sources=own_tensors(trainer))
    return probe.timed / (probe.t1 - probe.t0), blocked, own_floor


def rows_of(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(method, interval, tensors) of every fit in one round; the baseline once per tensor count."""
    out: list[tuple[str, int, int]] = []
    for n in args.tensors:
        out.append(("none", 0, n))
        out += [(m, every, n) for every in args.every for m in args.methods[1:]]
    return out


def own_tensors(trainer: Any) -> list[Any]:
    """The tensors a save of ``trainer``'s fit stages: its module's ``state_dict`` and its
    optimizer's state, where they lie in memory (for :func:`copy_floor`)."""
    import torch

    module, optimizer = trainer.lightning_module, trainer.optimizers[0]
    moments = (t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))
    return [*module.state_dict().values(), *moments]


def copy_floor(width: int, n_tensors: int, device: str, repeats: int = 7, sources: list[Any] | None = None) -> float:
    """Seconds to copy the fit's state (parameters and SGD momentum, as many tensors) into
    preallocated, touched buffers with one ``_foreach_copy_``: the blocking floor of a save.
    Caches are flushed before each copy (64 MiB written): in a fit the step and the writer
    evict the state between two saves, and a state of a few MiB copied in a hot loop would
    stay in the cache and set a floor no save can meet. On CUDA: device to pinned host
    buffers, synchronized (what the stager does there). ``sources``: the tensors to copy
    (a fit's own, where they lie in memory); default those of a new model of the fit's shape."""
    import torch

    cuda = device == "cuda"
    if sources is None:
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
    torch.set_num_threads(args.threads)
    group = None
    if args.world > 1:
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)  # Lightning's DDP finds it initialised and uses it
        group = dist.new_group(backend="gloo")  # DCP's background collectives stay off DDP's group
    rank = int(os.environ.get("RANK", "0"))
    root = os.path.join(args.root, f"world{args.world}")
    results: dict[str, Any] = {"rates": {}, "blocked": {}, "floor": {}, "own_floor": {}}
    rows = rows_of(args)
    started = time.perf_counter()
    for n in args.tensors:  # a process's first fit pays one-time costs (lazy imports, first touches)
        one_fit("none", 1, argparse.Namespace(**{**vars(args), "steps": 3, "every": [0]}), n, root, group)
    for rnd in range(args.rounds):
        for method, every, n in rows if rnd % 2 == 0 else list(reversed(rows)):
            t0 = time.perf_counter()
            rate, blocked, own_floor = one_fit(method, every, args, n, root, group)
            key = f"{method}|{every}|{n}"
            results["rates"].setdefault(key, []).append(rate)
            results["blocked"].setdefault(key, []).append(blocked)
            results["own_floor"].setdefault(key, []).append(own_floor)
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
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Start ``world`` ranks (Lightning's environment variables: it launches none itself)."""
    out = os.path.join(root, f"results-{world}.json")
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "GROUP_RANK": "0"}  # fmt: skip
        if world == 1:
            for name in ("MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
                env.pop(name)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--world", str(world), "--out", out,
               "--root", root, *worker_argv(args)]  # fmt: skip
        # Lightning's banner lines ("GPU available", tips) go to the workers' stdout: dropped
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"bench_fit_overhead: a {world}-rank worker failed (exit codes {codes})")
    with open(out) as f:
        return dict(json.load(f))


def worker_argv(args: argparse.Namespace) -> list[str]:
    return ["--width", str(args.width), "--step-ms", str(args.step_ms), "--max-window", str(args.max_window), "--batch", str(args.batch), "--threads", str(args.threads), "--steps", str(args.steps),
            "--saves", str(args.saves), "--rounds", str(args.rounds), "--window-s", str(args.window_s), "--every", ",".join(map(str, args.every)),
            "--tensors", ",".join(map(str, args.tensors)), "--device", args.device,
            "--methods", ",".join(args.methods)]  # fmt: skip


def report(results: dict[int, dict[str, Any]], args: argparse.Namespace, took: float, load: tuple[str, str]) -> str:
    rows, verdicts, blocking_rows, overlap_lines = [], [], [], []
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
                for m in ours:
                    fits = res["blocked"][f"{m}|{every}|{n}"]
                    pairs = [(median(b), f) for b, f in zip(fits, res["own_floor"][f"{m}|{every}|{n}"], strict=True) if b and f]
                    if not pairs:
                        continue
                    ratios = [b / f for b, f in pairs]  # each fit against the copy of its own tensors
                    met = sum(r <= 1.2 for r in ratios)
                    blocking_rows.append([str(world), str(n), str(every), LABELS[m],
                                          f"{1e3 * median([b for b, _ in pairs]):.2f}",
                                          f"{1e3 * median([f for _, f in pairs]):.2f}", f"{1e3 * floor:.2f}",
                                          f"{median(ratios):.2f}", f"{met} of {len(ratios)}"])  # fmt: skip
                if "ours_overlap" in over and "ours" in over:  # decides staging/overlap.py's AUTO_ON_CUDA
                    better = over["ours_overlap"] < over["ours"]
                    overlap_lines.append(f"- {world} rank(s), {n} tensors, every {every}: overlap_staging=True "
                                         f"{over['ours_overlap']:+.1f}% vs off {over['ours']:+.1f}%: "
                                         f"{'on is better' if better else 'off is better or equal'}")  # fmt: skip
                target = {1: 10.0, 10: 2.0}.get(every)
                # the blocking floor of a save as overhead: a rank copies ~1/N of the state under DDP
                floor_pct = 100 * floor / world * median(base) / every
                for m in ours:
                    line = f"- {world} rank(s), {n} tensors, every {every}: {m} {over[m]:+.1f}%"
                    if target is not None:
                        line += f" (target <= {target:g}%: {'met' if over[m] <= target else 'MISSED'})"
                    line += f"; copy floor {1e3 * floor / world:.1f} ms a rank = {floor_pct:.1f}% of {every} step(s)"
                    if target is not None and floor_pct > target:
                        line += " (the floor alone exceeds the target: out of reach on this machine)"
                    if "dict_only" in over:
                        # What any save through Trainer.save_checkpoint pays before storing a byte:
                        # Lightning's checkpoint dict (measured, row f) plus the copy out of the
                        # training state (its floor, above).
                        least = over["dict_only"] + floor_pct
                        line += (f"; Lightning's checkpoint dict alone {over['dict_only']:+.1f}%, with the copy floor "
                                 f"{least:+.1f}%: ours {over[m] - least:+.1f} points above that")
                        if target is not None and least > target:
                            line += " (dict + copy exceed the target: no save through Lightning meets it here)"
                    if "dict_copy" in over:
                        line += (f"; measured dict + copy (g) {over['dict_copy']:+.1f}%: ours "
                                 f"{over[m] - over['dict_copy']:+.1f} points above it")
                    if others:
                        best = min(others, key=lambda o: over[o])
                        ahead = all(over[m] < over[o] for o in others)
                        line += f"; ahead of (b)-(d): {'yes' if ahead else 'NO'} (best other {over[best]:+.1f}%)"
                    verdicts.append(line)
    state_mib = 2 * N_LAYERS * (args.width * args.width + args.width) * 4 / MiB
    return "\n".join([
        f"### Whole-fit overhead: {N_LAYERS} Linear {args.width}x{args.width} + SGD momentum "
        f"(~{state_mib:.1f} MiB of state), batch {args.batch}, device {args.device}, "
        + (f"step = CPU forward/backward + {args.step_ms:g} ms sleep standing for accelerator time"
           if args.step_ms > 0 else "pure-CPU step (no accelerator-time emulation)"),
        "",
        f"{args.rounds} round(s); timed window a fit: max({args.steps} steps, {args.saves} saves). "
        f"Machine: {machine_notes()}; {args.threads} intra-op thread(s) a rank in the fits; run took {took:.0f}s",
        f"`uptime` before: {load[0]}; after: {load[1]}",
        "",
        table(["ranks", "tensors", "save every", "method", "steps/s (median)", "range", "overhead"], rows),
        "",
        "Overhead = median over rounds of (no-checkpointing rate / row rate - 1); targets for ours: "
        "<= 2% every 10 steps, <= 10% every step, ahead of (b)-(d) in every row. (f) is no method: "
        "the checkpoint dict every save through `Trainer.save_checkpoint` builds, (b), (c) and ours included.",
        "",
        *verdicts,
        *(["", f"The overlap switch (`AUTO_ON_CUDA` in staging/overlap.py; device {args.device}):", *overlap_lines]
          if overlap_lines else []),
        "",
        "Time a save of ours blocks training inside these fits (`Saver.history`: split, skeleton, "
        "staging copy; without the wait for the previous save), per fit the median over its timed "
        "saves, against the copy floor of that fit's own tensors (its module's and optimizer's, where "
        "they lie, one `_foreach_copy_` into touched buffers, caches flushed before each copy, right "
        "after the fit); beside it the floor of a new model's tensors between the fits (it moves with "
        "where they land); under DDP a rank stages about 1/N of either:",
        "",
        table(["ranks", "tensors", "save every", "method", "blocks (ms)", "copy floor, own tensors (ms)",
               "a new model's (ms)", "blocks / own floor", "fits <= 1.2x"], blocking_rows),
    ])  # fmt: skip


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 round, 1 rank: the code paths")
    p.add_argument("--full", action="store_true", help="3 rounds of longer windows (--steps 40 --saves 3)")
    p.add_argument("--dry-run", action="store_true", help="--quick with every method (the overlap rows too)")
    p.add_argument("--width", type=int, default=384, help="Linear width (default 384: ~7 MiB of state)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=None,
                   help="accelerator-time emulation: each step sleeps this long after its CPU forward/backward "
                        "(default 50 on CPU, 0 on CUDA; 0: the pure-CPU step, the writer competing for its cores)")  # fmt: skip
    p.add_argument("--max-window", type=int, default=100,
                   help="timed steps a fit, at most, once it holds one save (default 100)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads a rank (default 1, as torchrun)")
    p.add_argument("--steps", type=int, default=10, help="timed steps a fit, at least (default 10; --full 40)")
    p.add_argument("--saves", type=int, default=2, help="timed saves a fit, at least (default 2; --full 3)")
    p.add_argument("--rounds", type=int, default=1, help="rounds (default 1; --full 3)")
    p.add_argument("--window-s", type=float, default=4.0,
                   help="a timed window closes after this many seconds once it holds --saves saves (default 4; --full 30)")  # fmt: skip
    p.add_argument("--every", type=ints, default=[1, 10, 100], help="save intervals (default 1,10,100)")
    p.add_argument("--tensors", type=ints, default=[24, 4000], help="tensor counts (default 24,4000)")
    p.add_argument("--ranks", type=ints, default=[1, 2], help="world sizes (default 1,2)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--methods", type=lambda t: t.split(","), default=None,
                   help=f"rows (default: all of {','.join(METHODS)}; ours_overlap only on CUDA)")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.step_ms is None:
        args.step_ms = 0.0 if args.device == "cuda" else 50.0
    if args.methods is None:
        # On CUDA ours runs twice, overlap_staging off and on: the row pair that decides
        # staging/overlap.py's AUTO_ON_CUDA (docs/staging.md). On CPU overlap is known to cost.
        # (g) too on CUDA (the device-to-host copy's floor inside a fit); on CPU only when asked:
        # the default table's time stays as it was (docs/benchmarks.md).
        cuda_rows = args.device == "cuda" or args.dry_run  # (the dry run: the CUDA table's rows)
        args.methods = [m for m in METHODS if m not in ("ours_overlap", "dict_copy") or cuda_rows]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or args.methods[0] != "none":
        p.error(f"--methods: start with none, choose from {','.join(METHODS)} (got {','.join(args.methods)})")
    if args.worker:
        return worker(args)
    given = argv if argv is not None else sys.argv[1:]
    if args.full:
        for name, value in (("steps", 40), ("saves", 3), ("rounds", 3), ("window_s", 30.0)):
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
