"""A fork server for the training scripts: it imports torch, Lightning and the package once,
then forks a child per launch that runs a script as ``python script args…`` would.

Each training script started as a fresh interpreter pays ~3.5 s of CPU for its imports
before it trains a step; a child forked from here starts in milliseconds. The child is a
real process: its own PID (what ``jobs.Job.pid`` reports, what leases record), real
signals (SIGTERM, SIGKILL from the test go straight to it), its exit status (``143``,
``-9``…) reported by the server that reaps it, its stdout and stderr in the test's pipe,
its environment and working directory as asked. DDP ranks > 0 that Lightning launches
are fresh interpreters (``sys.executable`` + the script's argv), as usual.

Protocol (one Unix-socket connection per launch): the client sends one JSON line
``{"script", "args", "cwd", "env"}`` with the write end of its output pipe attached
(SCM_RIGHTS); the server answers ``pid <n>`` once forked and ``exit <status>`` (a
``waitpid`` status) once the child is reaped.

Run as ``python zygote.py <socket path>``; it exits when the client end of its stdin
closes (the pytest process that started it is gone).
"""

from __future__ import annotations

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

# What the scripts import, imported once here (before any thread exists: forking is safe).
PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning",
    "lightning.pytorch",
    "lightning_preempt",
    "lightning_preempt.lightning.callback",
    "lightning_preempt.lightning.checkpoint_io",
    "models",
)


def _child(request: dict[str, object], out_fd: int) -> int:
    """In the forked child: become ``python script args…`` and run it; returns its exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
    sys.argv = [script, *[str(a) for a in request["args"]]]  # type: ignore[union-attr]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
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


def serve(path: str) -> int:
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
            os.close(fds[0])
            conn.sendall(f"pid {pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                conn.sendall(f"exit {status}\n".encode())
                conn.close()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
