"""Nothing the tests start outlives them: the process groups (and their descendants) of the
jobs, agents and servers a test run started are SIGKILLed when the test that started them
ends, and when the pytest process that started them is gone, however it went (an aborted
run, a SIGKILLed xdist worker: orphaned torchrun agents and training jobs were seen 8 minutes
later, holding ports and CPU).

:func:`track` names a process that leads a group of its own (``start_new_session=True`` or a
zygote job). Two things kill what is tracked:

* :func:`end_test` (an autouse fixture of tests/conftest.py, after the test's own fixtures):
  the processes tracked since that test began, still running: a test that failed or was
  interrupted half-way left them behind. ``per_test=False`` (a server a module fixture keeps
  across tests) leaves a process to its owner and to the watchdog.
* the watchdog, a small process of its own session (``python reaper.py``; a kill of pytest's
  process group does not reach it) that reads ``+pid`` / ``-pid`` lines from pytest and, when
  its stdin ends because pytest is gone, kills every tracked process still there.

A process is killed with its process group and its descendants found through ``/proc`` (torchrun
starts its workers in sessions of their own: only their parent links them to the agent), and
only while it is the process that was tracked (its start time in ``/proc/<pid>/stat``): a
recycled PID is left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

_lock = threading.Lock()
#: pid -> (its start time in clock ticks, killed at the end of the test that started it)
_tracked: dict[int, tuple[int, bool]] = {}
_test_start: set[int] = set()  # what was tracked when the current test began
_watchdog: subprocess.Popen[bytes] | None = None


def _stat(pid: int) -> tuple[int, int, int] | None:
    """``(ppid, pgid, start time)`` of ``pid``, or ``None`` when there is no such process (or
    only its zombie: nothing left to kill)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":
        return None
    # after "pid (comm)": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice num_threads itrealvalue starttime
    return int(fields[1]), int(fields[2]), int(fields[19])


def _started(pid: int) -> int:
    stat = _stat(pid)
    return stat[2] if stat is not None else -1


def kill_trees(roots: dict[int, int]) -> int:
    """SIGKILL each ``pid`` of ``roots`` (pid -> start time) that is still that process, its
    process group and every descendant; a few rounds, for children forked meanwhile. How many."""
    killed = 0
    for _ in range(5):
        table = {}
        for name in os.listdir("/proc"):
            if name.isdigit() and (stat := _stat(int(name))) is not None:
                table[int(name)] = stat
        victims = set()
        for pid, started in roots.items():
            root = table.get(pid)
            if root is not None and root[2] != started:
                continue  # a recycled PID: not ours
            if root is not None:
                victims.add(pid)
            # its group (what is left of it once the leader is gone started after it)
            victims |= {p for p, (_, pgid, t) in table.items() if pgid == pid and t >= started}
        frontier = set(victims)
        while frontier:
            frontier = {p for p, (ppid, _, _t) in table.items() if ppid in frontier} - victims
            victims |= frontier
        victims.discard(os.getpid())
        if not victims:
            break
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def _tell_watchdog(line: str) -> None:
    global _watchdog
    if _watchdog is None or _watchdog.poll() is not None:
        _watchdog = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    assert _watchdog.stdin is not None
    with contextlib.suppress(OSError):
        _watchdog.stdin.write(line.encode() + b"\n")
        _watchdog.stdin.flush()


def track(pid: int, *, per_test: bool = True) -> None:
    """Kill ``pid`` (the leader of a process group), its group and its descendants when the
    current test ends (unless ``per_test=False``) or when this process is gone."""
    started = _started(pid)
    with _lock:
        _tracked[pid] = (started, per_test)
        _tell_watchdog(f"+{pid} {started}")


def untrack(pid: int) -> None:
    """``pid`` was reaped by its owner: nothing to kill any more."""
    with _lock:
        if _tracked.pop(pid, None) is not None:
            _tell_watchdog(f"-{pid} 0")


def begin_test() -> None:
    with _lock:
        _test_start.clear()
        _test_start.update(_tracked)


def end_test() -> int:
    """Kill what was tracked (``per_test``) since :func:`begin_test` and is still running."""
    with _lock:
        mine = {pid: started for pid, (started, per_test) in _tracked.items() if per_test and pid not in _test_start}
    killed = kill_trees(mine) if mine else 0
    for pid in mine:
        untrack(pid)
    return killed


def _watch() -> int:
    """The watchdog: until stdin ends, keep the list; then kill what is on it."""
    roots: dict[int, int] = {}
    for line in sys.stdin:
        sign, pid, started = line[0], *line[1:].split()
        if sign == "+":
            roots[int(pid)] = int(started)
        else:
            roots.pop(int(pid), None)
    kill_trees(roots)
    return 0


if __name__ == "__main__":
    sys.exit(_watch())
