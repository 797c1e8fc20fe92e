"""A fork server for the training scripts: it imports torch, Lightning and the package once,
then forks a child per launch that runs a script as ``python script args…`` would.

Each training script started as a fresh interpreter pays ~3.5 s of CPU for its imports
before it trains a step; a child forked from here starts in milliseconds. The child is a
real process: its own PID (what ``jobs.Job.pid`` reports, what leases record), real
signals (SIGTERM, SIGKILL from the test go straight to it), its exit status (``143``,
``-9``…) reported by the server that reaps it, its stdout and stderr in the test's pipe,
its environment and working directory as asked. Each job leads a process group of its own
(what ``reaper.py`` kills when the test ends, and what this server kills when it exits).

The ranks > 0 that Lightning's subprocess launcher starts for ``devices=N`` (``python
script args…`` again, with ``LOCAL_RANK`` set) are forked from here too, into the job's process
group, their output in the job's: a 2-rank DDP job no longer pays a fresh interpreter (~4.5 s of
CPU, 5-8 s before its first step on a loaded machine) for rank 1. What Lightning holds for
that rank (``pid``, ``poll``, ``returncode``, ``send_signal``, ``wait``) is a ``jobs.Job``.

Protocol (one Unix-socket connection per launch): the client sends one JSON line
``{"script", "args", "cwd", "env", "pgid"}`` with the write end of its output pipe attached
(SCM_RIGHTS; ``pgid``: the group to join, 0 for a group of its own); the server answers ``pid
<n>`` once forked and ``exit <status>`` (a ``waitpid`` status) once the child is reaped.

Run as ``python zygote.py <socket path>``; it exits when the client end of its stdin
closes (the pytest process that started it is gone), SIGKILLing the groups of the jobs still
running.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import tempfile
import threading
import traceback
from typing import Any

# What the scripts import, imported once here (before any thread exists: forking is safe).
PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning",
    "lightning.pytorch",
    "lightning.fabric.strategies.launchers.subprocess_script",
    "lightning.pytorch.strategies.launchers.subprocess_script",
    "torch.distributed.run",
    "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
    "lightning_preempt",
    "lightning_preempt.lightning.callback",
    "lightning_preempt.lightning.checkpoint_io",
    "models",
    "jobs",
)
SOCKET = ""  # this server's, once listening (a job's Lightning launcher asks it for the ranks)


class _RanksFromHere:
    """Stands for the ``subprocess`` module in Lightning's subprocess launchers, in a job:
    ``Popen([sys.executable, script, …])`` forks the rank from this server (into the job's
    process group, its output where the job's goes); anything else is the real ``Popen``."""

    def __getattr__(self, name: str) -> object:
        import subprocess

        return getattr(subprocess, name)

    def Popen(
        self, command: list[str], env: dict[str, str] | None = None, cwd: str | None = None, **kwargs: object
    ) -> object:
        import subprocess

        import jobs

        if kwargs or len(command) < 2 or command[0] != sys.executable or command[1].startswith("-"):
            return subprocess.Popen(command, env=env, cwd=cwd, **kwargs)  # type: ignore[call-overload]
        return jobs.Job(list(command[1:]), cwd or os.getcwd(), dict(os.environ if env is None else env),
                        socket_path=SOCKET, pgid=os.getpgrp(), out_fd=1)  # fmt: skip


def _route_torchrun_workers_here() -> None:
    """In a torchrun agent forked from here: its workers (``python -u script args…``, each in a
    session of its own) are forked from here too, each leading a process group of its own (the
    agent stops one with ``os.killpg``), their output where the agent's goes. A worker whose
    output the agent redirects to files (``--redirects``/``--tee``) is the real ``Popen``."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    original = handler._popen

    def _popen(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
        import jobs

        if self._stdout or self._stderr or len(args) < 3 or args[:2] != (sys.executable, "-u") or args[2][:1] == "-":
            return original(self, args, env)
        return jobs.Job(list(args[2:]), os.getcwd(), env, socket_path=SOCKET, out_fd=1, unbuffered=True)

    handler._popen = _popen  # type: ignore[method-assign]


def _route_lightning_ranks_here() -> None:
    ranks = _RanksFromHere()
    for name in (
        "lightning.fabric.strategies.launchers.subprocess_script",
        "lightning.pytorch.strategies.launchers.subprocess_script",
    ):
        sys.modules[name].subprocess = ranks  # type: ignore[attr-defined]


def _child(request: dict[str, object], out_fd: int) -> int:
    """In the forked child: become ``python script args…`` and run it; returns its exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(OSError):  # (the server set it too: whichever runs first)
        os.setpgid(0, int(request.get("pgid") or 0))  # type: ignore[call-overload]
    _route_lightning_ranks_here()
    _route_torchrun_workers_here()
    script = str(request["script"])
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})  # type: ignore[call-overload]
    tempfile.tempdir = None  # gettempdir() asks $TMPDIR again (a test may set its own)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(null)
    os.close(out_fd)
    if request.get("unbuffered"):  # python -u
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    args = [str(a) for a in request["args"]]  # type: ignore[union-attr]
    try:
        if script == "-m":  # python -m module args…
            sys.argv = ["-m", *args[1:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _kill_children(children: dict[int, socket.socket]) -> None:
    """The tests are gone: nothing they started may train on (its group: the ranks it launched)."""
    for pid in children:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def serve(path: str) -> int:
    global SOCKET
    SOCKET = path
    for name in PRELOAD:
        __import__(name)
    assert threading.active_count() == 1, f"threads before forking: {threading.enumerate()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            _kill_children(children)
            return 0  # the test process is gone
        if listener in readable:
            conn, _ = listener.accept()
            line, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                raise SystemExit(_child(request, fds[0]))  # a normal exit: atexit handlers run
            with contextlib.suppress(OSError):  # (the child did it too: whichever runs first)
                os.setpgid(pid, int(request.get("pgid") or 0) or pid)
            os.close(fds[0])
            with contextlib.suppress(OSError):  # a client gone already (SIGKILLed): reap all the same
                conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # the job that asked for this rank may be gone
                    conn.sendall(f"exit {status}\n".encode())
                conn.close()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
