"""A torchrun agent that cannot reach its rendezvous store after its workers exited leaves.

A partition that cuts off the node hosting the c10d rendezvous store (or that node lost while
the TCP connections stay open) leaves the other nodes' agents blocked in a store call for good,
whatever ``read_timeout`` says: torch's agent checks the store at every monitor tick under the
rendezvous handler's lock, which its keep-alive thread keeps taking (docs/failure-detection.md).

:class:`AgentWatch` runs on a thread of the agent (``python -m lightning_preempt.torchrun``):
once every worker has exited for ``grace_s``, one with a failure's code (1-127, read from its
unreaped zombie's ``/proc/<pid>/stat``: the failure verdict's 75, a crash's 1), and the store
accepts no TCP connection within ``probe_s``, it prints one line and ends the agent with that
code. It leaves alone an agent whose store answers, workers that ended well or by a signal (a
preemption's 143: the agent's own way out, a SLURM requeue among it) and reaped workers. While
the agent may still restart its workers, the store must be silent for torch's ``read_timeout``
(60 s by default), not one probe. A worker is its pid *and* start time (a reused pid is another
worker). Linux only (``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable


class AgentWatch(threading.Thread):
    """Watches this process's children started after it (the workers) and the store at
    ``host:port``; ``leave(code)`` ends the agent (``os._exit``). ``max_restarts``: the
    agent's ``--max-restarts``; while worker generations seen do not exceed it, the store
    must be silent for ``store_timeout_s`` (torch's rendezvous ``read_timeout``), not one probe."""

    def __init__(self, host: str, port: int, *, grace_s: float = 1.0, probe_s: float = 2.0,
                 interval_s: float = 0.5, max_restarts: int = 0, store_timeout_s: float = 60.0,
                 leave: Callable[[int], None] = os._exit) -> None:  # fmt: skip
        super().__init__(name="lightning_preempt-agent-watch", daemon=True)
        self.host, self.port = host, port
        self.grace_s, self.probe_s, self.interval_s = grace_s, probe_s, interval_s
        self.max_restarts, self.store_timeout_s = max_restarts, store_timeout_s
        self._leave = leave
        self._codes: dict[Worker, int] = {}  # exit codes read from the workers' zombies
        self._before = set(_workers(children(os.getpid())))  # not workers: the agent starts them later
        self.generations = 0  # sets of workers seen running (the first, then one per restart)
        self.stop = threading.Event()

    def run(self) -> None:
        failed_since: float | None = None  # every worker gone, one of them failed
        silent_since: float | None = None  # the store's first missed probe since it last answered
        running = False
        while not self.stop.wait(self.interval_s):
            kids = {w: f for w, f in _workers(children(os.getpid())).items() if w not in self._before}
            for worker, fields in kids.items():
                if fields[0] == "Z" and len(fields) >= 50:
                    self._codes.setdefault(worker, exit_code(int(fields[49])))  # field 52: the wait status
            if any(fields[0] not in "ZX" for fields in kids.values()):
                if not running:
                    self.generations += 1
                running, failed_since, silent_since = True, None, None
                # (after a restart, the earlier workers' codes are history)
                self._codes = {w: code for w, code in self._codes.items() if w in kids}
                continue
            running = False
            code = next((c for c in self._codes.values() if 0 < c < 128), None)
            if code is None:
                continue  # none yet, a clean end, or a signal's (a preemption: the agent's own way out)
            now = time.monotonic()
            failed_since = failed_since if failed_since is not None else now
            if now - failed_since < self.grace_s:
                continue
            if reachable(self.host, self.port, self.probe_s):
                silent_since = None
                continue
            silent_since = silent_since if silent_since is not None else now
            # restarts used: the generations seen, less the first (one, even if seen only exited)
            may_restart = max(self.generations, 1) - 1 < self.max_restarts
            if may_restart and time.monotonic() - silent_since < self.store_timeout_s:
                continue  # torch's rendezvous would still wait for the store
            print(f"lightning_preempt.torchrun: the workers exited and the rendezvous store at {self.host}:"
                  f"{self.port} does not answer (a partition, or its host lost); exiting with {code} instead of "
                  "waiting for it\nHINT: host the store on a node that stays (python -m lightning_preempt.elastic "
                  "store; docs/elastic.md).", file=sys.stderr, flush=True)  # fmt: skip
            self._leave(code)
            return


def read_timeout_s(rdzv_conf: str) -> float:
    """The ``read_timeout`` of torchrun's ``--rdzv-conf`` (``k=v,k=v``): how long torch's c10d
    rendezvous waits for its store (60 s unless set; torch 2.7-2.13)."""
    conf = dict(kv.split("=", 1) for kv in rdzv_conf.split(",") if "=" in kv)
    try:
        value = float(conf.get("read_timeout", "60").strip())
    except ValueError:
        return 60.0  # torch refuses it itself
    return value if value > 0 else 60.0


#: A worker: its pid and its start time (``/proc/<pid>/stat`` field 22), so a reused pid is another.
Worker = tuple[int, str]


def _workers(kids: dict[int, list[str]]) -> dict[Worker, list[str]]:
    return {(pid, fields[19] if len(fields) > 19 else ""): fields for pid, fields in kids.items()}


def reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after ``(comm)`` (field 3, the state, first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def children(parent: int) -> dict[int, list[str]]:
    """``{pid: stat fields}`` of ``parent``'s child processes (``/proc``; empty elsewhere):
    from the threads' ``children`` lists where the kernel keeps them, else by a scan."""
    try:
        lists = [f"/proc/{parent}/task/{tid}/children" for tid in os.listdir(f"/proc/{parent}/task")]
        if os.path.exists(lists[0]):
            pids = {int(p) for path in lists for p in _read(path).split()}
        else:
            pids = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    except (OSError, IndexError, ValueError):
        return {}
    out = {}
    for pid in pids:
        fields = _stat(pid)
        if fields is not None and len(fields) > 1 and fields[1] == str(parent):
            out[pid] = fields
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or ``128 + signal``."""
    return 128 + (status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF
