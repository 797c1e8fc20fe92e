"""The processes a test or a benchmark starts, watches and kills, and the markdown they print
(tests/support/fault_injection.py, netns_job.py, benchmarks/_harness.py)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine_notes() -> str:
    """When and where a figure was taken: the time, host, CPUs, torch, the load average."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {platform.node()}; {os.cpu_count()} CPUs; "
        f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads); python {platform.python_version()}; "
        f"loadavg {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}"
    )


def git_revision(root: Path) -> str:
    """The short commit of ``root``'s checkout ("?" outside one)."""
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return done.stdout.strip()


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


def read_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A status file another process may be writing: ``{}`` while it is absent or partial."""
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
