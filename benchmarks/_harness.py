"""The one benchmark harness: state builders, timing (interleaved rounds, medians), the ratio
table "ours vs baselines vs floor", RSS sampling, and starting N ranks. The processes a
benchmark starts and watches, and its markdown, come from tests/support/procs.py (the tests'
fault-injection harness uses them too)."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from procs import (  # noqa: E402,F401  (re-exported: the benchmarks import all of it from here)
    RankFiles,
    free_port,
    git_revision,
    kill_group,
    launch,
    machine_notes,
    pid_alive,
    read_json,
    table,
    wait_gone,
    wait_until,
)

T = TypeVar("T")
MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------- states and models
def lightning_style_checkpoint(total_bytes: int, n_tensors: int, step: int = 100) -> dict[str, Any]:
    """A Lightning-shaped checkpoint dict holding ~``total_bytes`` of float32 tensors: half the
    tensors "weights" under ``state_dict``, half SGD momentum buffers under ``optimizer_states``."""
    n_weights = max(1, n_tensors // 2)
    n_moments = max(1, n_tensors - n_weights)
    rows = max(1, total_bytes // (4 * (n_weights + n_moments)) // 1024)
    gen = torch.Generator().manual_seed(0)
    state_dict = {f"layers.{i}.weight": torch.randn(rows, 1024, generator=gen) for i in range(n_weights)}
    opt_state = {i: {"momentum_buffer": torch.randn(rows, 1024, generator=gen)} for i in range(n_moments)}
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": state_dict,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "callbacks": {},
        "optimizer_states": [
            {"state": opt_state, "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": list(range(n_moments))}]}
        ],
        "lr_schedulers": [],
    }


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list structure, in a stable order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for v in values for t in tensors_of(v)]


def nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(obj))


def lightning_job() -> tuple[type, type]:
    """``(Big, Noise)``: a stack of bias-free square ``Linear`` layers with SGD, and an endless
    deterministic dataset (imports Lightning: only the processes that train call this)."""
    import lightning as L
    from torch.utils.data import Dataset

    class Big(L.LightningModule):
        def __init__(self, width: int, n_layers: int, lr: float, momentum: float = 0.0) -> None:
            super().__init__()
            self.lr, self.momentum = lr, momentum
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n_layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out: torch.Tensor = self.net(batch).pow(2).mean()
            return out

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    class Noise(Dataset[torch.Tensor]):
        def __init__(self, width: int) -> None:
            self.width = width

        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.ones(self.width) * (i % 7)

    return Big, Noise


# ---------------------------------------------------------------- timing
def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def fmt_s(x: float | None) -> str:
    return "—" if x is None or x != x else f"{x:.3f}"


def fmt_range(xs: Sequence[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}" if xs else "—"


def interleaved(runners: dict[str, Callable[[], T]], rounds: int, *, between: Callable[[], None] | None = None,
                before: Callable[[str], None] | None = None) -> dict[str, list[T]]:  # fmt: skip
    """Each runner once per round, the order rotated every round (no fixed neighbour); round 0
    warms every path up and is not kept. ``before(name)`` / ``between()`` run outside the timing."""
    names = list(runners)
    results: dict[str, list[T]] = {name: [] for name in names}
    for rnd in range(rounds + 1):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            if before is not None:
                before(name)
            result = runners[name]()
            if rnd:
                results[name].append(result)
            if between is not None:
                between()
    return results


def paired(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of per-round ratios ``a[i] / b[i]`` (numbers taken seconds apart)."""
    return median([x / y for x, y in zip(a, b, strict=True) if y])


def ratio_table(checks: Iterable[tuple[str, float, float, bool]],
                title: str = "Ratios (median of per-round ratios, same run):") -> list[str]:  # fmt: skip
    """The ratio table "ours vs baselines vs floor" and its verdict lines for
    ``(name, value, target, higher_is_better)`` checks (no lines when there are none)."""
    rows, lines = [], []
    for name, value, target, higher in checks:
        ok = value >= target if higher else value <= target
        sign, status = (">=" if higher else "<="), ("met" if ok else "MISSED")
        rows.append([name, f"{value:.2f}", f"{sign} {target:g}", status])
        lines.append(f"- {name}: {value:.2f} (target {sign} {target:g}): {status}")
    return [*([title, ""] if title else []), table(["ratio", "value", "target", "verdict"], rows), "", *lines] if rows else []


def header(title: str, extra: str = "") -> list[str]:
    """A report's first lines: its title and the machine it ran on (label loaded machines)."""
    return [f"### {title}", "", f"Machine: {machine_notes()}{'; ' + extra if extra else ''}", ""]


# ---------------------------------------------------------------- files and memory
def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_fsync(path: str, tensors: Sequence[torch.Tensor]) -> None:
    """The durable-write floor: ``tensors``' bytes in one sequential file, fsynced with its directory."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = t.numpy().data.cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(os.path.dirname(path) or ".")


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(base, n) for base, _, names in os.walk(path) for n in names)


def shard_writers(path: str, world: int) -> None:
    """Check that every one of ``world`` ranks wrote its own shard file (``__{R}_*.distcp``) of
    the checkpoint at ``path``: a benchmark measures the save it says it does."""
    writers = {int(n.split("_")[2]) for n in os.listdir(path) if n.startswith("__") and n.endswith(".distcp")}
    if writers != set(range(world)):
        raise SystemExit(f"{path}: shard files of ranks {sorted(writers)}, not of all {world} ranks")


def empty_dir(root: str) -> None:
    for entry in os.listdir(root):
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


@contextlib.contextmanager
def workdir(keep: str | None, prefix: str) -> Iterator[str]:
    """``keep`` (created, kept afterwards), else a fresh directory under /tmp, removed after."""
    root = keep or tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.makedirs(root, exist_ok=True)
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def rss() -> int:
    """This process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The peak RSS seen by a thread sampling every 0.5 ms while the ``with`` block runs."""

    def __enter__(self) -> PeakRSS:
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


# ---------------------------------------------------------------- processes
def this_script(file: str) -> list[str]:
    """The argv that runs a benchmark's own file again (its child mode)."""
    return [sys.executable, os.path.abspath(file)]


def spawn_ranks(argv: Sequence[str], world: int, *, stdout: Any = subprocess.DEVNULL) -> list[int]:
    """Run ``argv`` as ``world`` ranks on this host with the environment Lightning and torch read
    (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK...; none for one rank) and wait: the exit codes."""
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ)
        if world > 1:
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "GROUP_RANK": "0"}  # fmt: skip
        procs.append(subprocess.Popen(list(argv), env=env, stdout=stdout))
    return [p.wait() for p in procs]


def spawn_gloo(fn: Callable[..., None], world: int, *args: Any) -> None:
    """``fn(rank, init_file, world, *args)`` on ``world`` spawned processes, a gloo group
    initialised from a file in a temporary directory (torch.multiprocessing)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="lp-bench-init-") as d:
        mp.start_processes(_gloo_entry, args=(fn, os.path.join(d, "init"), world, args), nprocs=world,
                           start_method="spawn")  # fmt: skip


def _gloo_entry(rank: int, fn: Callable[..., None], init_file: str, world: int, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
