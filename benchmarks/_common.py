"""The one benchmark harness: state dicts, timing (medians), markdown and ratio tables,
verdicts, and the processes a benchmark starts, watches and kills (also used by
tests/support/netns_job.py)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")
MiB = 1 << 20
GiB = 1 << 30


def lightning_style_checkpoint(total_bytes: int, n_tensors: int, step: int = 100) -> dict[str, Any]:
    """A Lightning-shaped checkpoint dict holding ~``total_bytes`` of float32 tensors.

    Half the tensors are "weights" under ``state_dict``, half are SGD momentum buffers
    under ``optimizer_states`` (int keys, as torch optimizers produce them).
    """
    n_weights = max(1, n_tensors // 2)
    n_moments = max(1, n_tensors - n_weights)
    numel = total_bytes // (4 * (n_weights + n_moments))
    cols = 1024
    rows = max(1, numel // cols)
    gen = torch.Generator().manual_seed(0)
    state_dict = {f"layers.{i}.weight": torch.randn(rows, cols, generator=gen) for i in range(n_weights)}
    opt_state = {i: {"momentum_buffer": torch.randn(rows, cols, generator=gen)} for i in range(n_moments)}
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
    out: list[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(tensors_of(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(tensors_of(v))
    return out


def nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(obj))


def work_verdict(work: Path, ok: bool) -> int:
    """A benchmark's exit code, its work directory (checkpoints, the jobs' logs) removed when it
    passed and kept, named on stderr, when it did not: what went wrong is in there."""
    if ok:
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print(f"benchmark failed: its work directory (checkpoints, job logs) is kept in {work}", file=sys.stderr)
    return 1


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def fmt_s(x: float | None) -> str:
    if x is None or x != x:  # NaN
        return "—"
    return f"{x:.3f}"


def fmt_range(xs: Sequence[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}" if xs else "—"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def interleaved(runners: dict[str, Callable[[], T]], rounds: int, *, between: Callable[[], None] | None = None,
                before: Callable[[str], None] | None = None) -> dict[str, list[T]]:  # fmt: skip
    """Each runner once per round, the order rotated every round (no fixed neighbour); round 0
    warms every path up and is not kept. ``before(name)`` / ``between()`` run outside the
    timing (a touch of the state; emptying the scratch directory)."""
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


def empty_dir(root: str) -> None:
    """Remove everything under ``root`` (between timed runs: keep the disk tidy)."""
    for entry in os.listdir(root):
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def verdict(name: str, value: float, target: float, higher_is_better: bool) -> tuple[list[str], str]:
    """A ratio row for the table and a one-line verdict."""
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    status = "met" if ok else "MISSED"
    return [name, f"{value:.2f}", f"{sign} {target:g}", status], f"- {name}: {value:.2f} (target {sign} {target:g}): {status}"


def ratio_table(checks: Iterable[tuple[str, float, float, bool]], title: str = "Ratios (median of per-round ratios, "
                "same run):") -> list[str]:  # fmt: skip
    """The ratio table and its verdict lines for ``(name, value, target, higher_is_better)``
    checks (no lines when there are none)."""
    judged = [verdict(*check) for check in checks]
    if not judged:
        return []
    head = [title, ""] if title else []
    return [*head, table(["ratio", "value", "target", "verdict"], [row for row, _ in judged]), "",
            *(line for _, line in judged)]  # fmt: skip


def machine_notes() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {platform.node()}; {os.cpu_count()} CPUs; "
        f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads); python {platform.python_version()}; "
        f"loadavg {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}"
    )


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def git_revision(root: Path) -> str:
    """The short commit of ``root``'s checkout ("?" outside one)."""
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return done.stdout.strip()


# ---------------------------------------------------------------- processes
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


def launch(argv: Sequence[str], log_path: str | os.PathLike[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr into ``log_path`` (``kwargs``: Popen's)."""
    with open(log_path, "ab") as log:  # the child holds its own descriptor
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, **kwargs)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, not reaped yet, is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def wait_until(pred: Callable[[], Any], proc: subprocess.Popen[bytes] | None, timeout: float, *,
               poll_s: float = 0.005) -> bool:  # fmt: skip
    """Poll ``pred`` until it holds (True), ``timeout`` passes or ``proc`` exits (then: ``pred()``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(pred())
        time.sleep(poll_s)
    return False


def wait_gone(pids: Sequence[int], timeout: float) -> float | None:
    """Seconds until every pid is gone (``None``: some still run after ``timeout``)."""
    t0 = time.monotonic()
    while any(pid_alive(p) for p in pids):
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(0.02)
    return time.monotonic() - t0


def kill_group(proc: subprocess.Popen[bytes], pids: Sequence[int | None] = ()) -> None:
    """What a scheduler does at the end of a job step: SIGKILL ``proc``'s process group (it
    was started with ``start_new_session=True``) and any of ``pids`` still running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for pid in pids:
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


class RankFiles:
    """What tests/support/train_script.py reports in its status directory, per rank:
    ``rank{R}.step``, ``.pid``, ``.exit``, ``.result.json``."""

    def __init__(self, status: Path, ranks: int) -> None:
        self.status, self.ranks = status, ranks

    def read(self, rank: int, what: str) -> str | None:
        with contextlib.suppress(OSError):
            return (self.status / f"rank{rank}.{what}").read_text()
        return None

    def _int(self, rank: int, what: str) -> int | None:
        with contextlib.suppress(TypeError, ValueError):
            return int(self.read(rank, what))  # type: ignore[arg-type]
        return None

    def step(self, rank: int) -> int:
        """The rank's last step (-1 before its first)."""
        step = self._int(rank, "step")
        return -1 if step is None else step

    def steps(self) -> list[int]:
        """The steps of the ranks that reported one."""
        return [s for s in (self.step(r) for r in range(self.ranks)) if s >= 0]

    def pid(self, rank: int) -> int | None:
        return self._int(rank, "pid")

    def result(self, rank: int) -> dict[str, Any] | None:
        text = self.read(rank, "result.json")
        return dict(json.loads(text)) if text else None


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A status file another process may be writing: ``{}`` while it is absent or partial."""
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def this_script(file: str) -> list[str]:
    """The argv that runs a benchmark's own file again (its child mode)."""
    return [sys.executable, os.path.abspath(file)]
