"""Training jobs as real processes: start one of the scripts here, read the status files
it writes (``rank{R}.pid``, ``rank{R}.step``, ``rank{R}.exit``, ``rank{R}.result.json``) and
wait for a condition with a deadline, failing with the job's log when it ends first.

:func:`launch` forks the job from a zygote (zygote.py: torch, Lightning and the package
imported once per pytest process) instead of starting a fresh interpreter: the same real
process (PID, signals, exit status, output), without ~3.5 s of imports each time.
``LP_ZYGOTE=0`` starts fresh interpreters (``subprocess.Popen``) instead. Either way the job
leads a process group of its own, killed with whatever is left in it when the test ends or
the pytest process is gone (reaper.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import reaper

SUPPORT = Path(__file__).resolve().parent
T = TypeVar("T")
USE_ZYGOTE = os.environ.get("LP_ZYGOTE", "1") != "0"


def launch(script: str | Path, cwd: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """``python <script> args…`` in ``cwd`` (a name: a script here in support/), its
    stdout and stderr in one text pipe; ``env``: the whole environment (default: ours).

    Returns a :class:`subprocess.Popen` or a :class:`Job` (the same methods: ``pid``,
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``kill``, ``returncode``)."""
    argv = [str(SUPPORT / script), *args]  # (an absolute path stays itself)
    if USE_ZYGOTE:
        job: Any = Job(argv, cwd, dict(os.environ if env is None else env))
    else:
        job = subprocess.Popen(
            [sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
    reaper.track(job.pid)
    return job


class _Zygote:
    """The zygote of this process, started on first use; it exits when this process does."""

    proc: subprocess.Popen[bytes] | None = None
    path = ""

    @classmethod
    def socket_path(cls) -> str:
        if cls.proc is None or cls.proc.poll() is not None:
            folder = tempfile.mkdtemp(prefix="lp-zygote-")
            cls.path = os.path.join(folder, "sock")
            log = open(os.path.join(folder, "log"), "wb")  # noqa: SIM115 - the zygote's for its lifetime
            cls.proc = subprocess.Popen(
                [sys.executable, str(SUPPORT / "zygote.py"), cls.path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=SUPPORT,
            )  # fmt: skip
            log.close()
            assert cls.proc.stdout is not None
            ready = cls.proc.stdout.readline()
            if ready != b"ready\n":
                raise RuntimeError(f"the zygote did not start:\n{Path(folder, 'log').read_text()[-3000:]}")
            atexit.register(cls.stop)
        return cls.path

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.stdin is not None:
            cls.proc.stdin.close()  # its signal to exit
            cls.proc.wait(timeout=30)


class Job:
    """A script forked from the zygote: the parts of ``Popen`` the tests use.

    ``argv``: ``[script, args…]``, or ``["-m", module, args…]``. It leads a process group of its
    own, or joins ``pgid``. ``socket_path``: the zygote to ask
    (default: this process's, started on first use); ``out_fd``: where its output goes (default: a
    pipe that :meth:`communicate` reads) — a job's Lightning launcher passes both (zygote.py)."""

    def __init__(self, argv: list[str], cwd: Path | str, env: dict[str, str], *, socket_path: str = "",
                 pgid: int = 0, out_fd: int = -1, unbuffered: bool = False) -> None:  # fmt: skip
        self.args = argv
        self.returncode: int | None = None
        self._chunks: list[bytes] = []
        self._lock = threading.Lock()  # Lightning's child observer polls from a thread of its own
        if out_fd < 0:
            read_end, write_end = os.pipe()
        else:
            read_end, write_end = -1, out_fd
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(socket_path or _Zygote.socket_path())
        request = {"script": argv[0], "args": argv[1:], "cwd": str(cwd), "env": env, "pgid": pgid,
                   "unbuffered": unbuffered}  # fmt: skip
        socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], [write_end])
        if out_fd < 0:
            os.close(write_end)
        self._out = read_end
        self._replies = self._conn.makefile("rb")
        line = self._replies.readline().decode()
        if not line.startswith("pid "):
            raise RuntimeError(f"the zygote did not start {argv[0]}: {line!r}")
        self.pid = int(line.split()[1])

    def _reap(self, timeout: float | None) -> None:
        with self._lock:
            self._reap_locked(timeout)

    def _reap_locked(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        line = self._replies.readline().decode()
        assert line.startswith("exit "), f"the zygote said {line!r}"
        self.returncode = os.waitstatus_to_exitcode(int(line.split()[1]))
        self._replies.close()
        self._conn.close()

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._reap(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._reap(timeout)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """All of the job's output (stdout and stderr), once it has ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._out >= 0:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._out], [], [], left)
            if not ready:  # the output so far is shown with the failure: a hang must be diagnosable
                tail = b"".join(self._chunks)[-6000:].decode(errors="replace")
                print(f"--- the job's output before the timeout (its own process: exit {self.poll()}; "
                      f"last 6000 bytes) ---\n{tail}", file=sys.stderr)  # fmt: skip
                raise subprocess.TimeoutExpired(self.args, timeout or 0, output=tail)
            chunk = os.read(self._out, 1 << 16)
            if chunk:
                self._chunks.append(chunk)
            else:  # every writer closed it: the job and the ranks it started
                os.close(self._out)
                self._out = -1
        self._reap(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return b"".join(self._chunks).decode(errors="replace"), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: a job reaped already is not signalled (its PID may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def step_of(status: Path, rank: int = 0) -> int | None:
    """The global step rank ``rank`` last reported, or ``None`` before its first step."""
    try:
        return int((status / f"rank{rank}.step").read_text())
    except (FileNotFoundError, ValueError):
        return None


def wait_for(proc: subprocess.Popen[str], what: str, pred: Callable[[], T], timeout: float = 120.0) -> T:
    """Poll ``pred`` until it returns something truthy (returned); fail when the job ends
    first or after ``timeout`` seconds (then the job is killed), with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"training ended before {what}:\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.02)  # a polling interval, not a synchronisation
    proc.kill()
    raise AssertionError(f"{what}: not within {timeout}s:\n{proc.communicate()[0][-4000:]}")


def env_with(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``."""
    return {**os.environ, **extra}
