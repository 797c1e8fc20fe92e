"""The torchrun agent's watch (lightning_preempt/agent_watch.py): an agent whose workers all
exited, one with a failure's code, and whose rendezvous store does not answer leaves with that
code; one whose store answers, or whose workers ended well or by a signal, is left alone.
Real child processes and real sockets on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator

import pytest
from servers import free_port  # a port bound, then closed: connecting is refused

from lightning_preempt import agent_watch
from lightning_preempt.agent_watch import AgentWatch, children, exit_code, read_timeout_s

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _worker(code: int | None) -> int:
    """A child that exits at once with ``code`` (``None``: SIGKILLs itself), left unreaped as a
    blocked agent leaves its workers (the test reaps it at the end)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        if code is None:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(code)
    return pid


def _seen(watch: AgentWatch, pid: int) -> bool:
    """The watch has read the exit code of the worker with ``pid``."""
    return any(worker[0] == pid for worker in watch._codes)


@pytest.fixture
def reap() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


@pytest.mark.parametrize("code", [75, 1])
def test_workers_failed_and_the_store_silent_the_agent_leaves_with_their_code(reap: list[int], code: int) -> None:
    left: list[int] = []
    watch = AgentWatch("127.0.0.1", free_port(), grace_s=0.1, probe_s=0.5, interval_s=0.02, leave=left.append)
    watch.start()
    reap.append(_worker(code))
    watch.join(timeout=20)
    assert not watch.is_alive() and left == [code]


@pytest.mark.parametrize("code", [0, None, 143])
def test_workers_that_ended_well_or_by_a_signal_keep_the_agent(reap: list[int], code: int | None) -> None:
    """A clean end, a SIGKILL, a preemption's 143: the agent has its own way out (a SLURM
    requeue among it), which the watch must not cut short, store or not."""
    left: list[int] = []
    watch = AgentWatch("127.0.0.1", free_port(), grace_s=0.0, probe_s=0.1, interval_s=0.02, leave=left.append)
    watch.start()
    pid = _worker(code)
    reap.append(pid)
    while not _seen(watch, pid):  # it has seen the exit
        assert watch.is_alive()
        watch.join(timeout=0.02)
    watch.join(timeout=1.0)  # many more looks, each finding the store gone
    assert watch.is_alive() and left == [], left
    watch.stop.set()
    watch.join(timeout=5)


def test_a_store_that_answers_keeps_the_agent(reap: list[int]) -> None:
    """Waiting for other agents (the exit barrier) or a new rendezvous: the store answers."""
    left: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as store:
        watch = AgentWatch("127.0.0.1", store.getsockname()[1], grace_s=0.05, probe_s=0.5, interval_s=0.02,
                           leave=left.append)  # fmt: skip
        watch.start()
        pid = _worker(75)
        reap.append(pid)
        # the watch saw the worker's exit code, so it has looked at least once since the exit
        while not _seen(watch, pid):
            assert watch.is_alive()
            watch.join(timeout=0.05)
        watch.join(timeout=1.0)  # many more looks, each finding the store there
        assert watch.is_alive() and left == []
        watch.stop.set()
        watch.join(timeout=5)


def test_no_worker_yet_is_not_gone_workers(reap: list[int]) -> None:
    """Before its first worker starts an agent has no children: nothing to leave for."""
    left: list[int] = []
    watch = AgentWatch("127.0.0.1", free_port(), grace_s=0.0, probe_s=0.1, interval_s=0.01, leave=left.append)
    watch.start()
    watch.join(timeout=0.5)
    assert watch.is_alive() and left == []
    watch.stop.set()
    watch.join(timeout=5)


def test_children_and_exit_codes_from_proc(reap: list[int]) -> None:
    pid = _worker(3)
    reap.append(pid)
    while children(os.getpid()).get(pid, ["?"])[0] != "Z":
        pass  # the child exits at once; a zombie until reaped
    fields = children(os.getpid())[pid]
    assert exit_code(int(fields[49])) == 3
    assert exit_code(signal.SIGTERM) == 128 + signal.SIGTERM and exit_code(75 << 8) == 75


def test_after_a_restart_only_the_new_workers_codes_count(reap: list[int]) -> None:
    """An elastic agent restarted its workers (the first exited 75, was reaped, a new one
    started); the new one then ends well and the store goes away: the earlier 75 does not
    make the agent leave."""
    left: list[int] = []
    store = socket.create_server(("127.0.0.1", 0))
    watch = AgentWatch("127.0.0.1", store.getsockname()[1], grace_s=0.05, probe_s=0.5, interval_s=0.02,
                       leave=left.append)  # fmt: skip
    watch.start()
    first = _worker(75)
    while not _seen(watch, first):
        assert watch.is_alive()
        watch.join(timeout=0.02)
    os.waitpid(first, 0)  # torch reaps it, and starts the next worker
    r, w = os.pipe()
    second = os.fork()
    if second == 0:  # pragma: no cover - the child: runs until the pipe closes
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    reap.append(second)
    while _seen(watch, first):  # forgotten once the new worker was seen alive
        assert watch.is_alive()
        watch.join(timeout=0.02)
    store.close()  # the store's host is gone
    os.close(w)  # the new worker ends well
    while not _seen(watch, second):
        assert watch.is_alive()
        watch.join(timeout=0.02)
    watch.join(timeout=1.0)
    assert watch.is_alive() and left == [], left
    watch.stop.set()
    watch.join(timeout=5)


def _stat(state: str, start: str, status: int = 0) -> list[str]:
    """``/proc/<pid>/stat`` fields from field 3 on: the state, the parent, the start time (field
    22), the wait status (field 52)."""
    fields = [state, str(os.getpid())] + ["0"] * 48
    fields[19], fields[49] = start, str(status)
    return fields


def test_a_new_worker_with_an_old_workers_pid_is_another_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 100 (started at tick 1000) failed with 75 while the store answered; the agent
    restarted; the new worker got pid 100 again (started at 2000) and ended well; then the
    store went away. The old 75 is not the new worker's: the agent stays."""
    script = [{}, {100: _stat("Z", "1000", 75 << 8)}, {100: _stat("R", "2000")}, {100: _stat("Z", "2000", 0)}]
    calls: list[int] = []

    def fake_children(parent: int) -> dict[int, list[str]]:
        calls.append(parent)
        return script[min(len(calls) - 1, len(script) - 1)]

    monkeypatch.setattr(agent_watch, "children", fake_children)
    monkeypatch.setattr(agent_watch, "reachable", lambda *_: len(calls) < len(script))  # gone at the end
    left: list[int] = []
    watch = AgentWatch("127.0.0.1", 1, grace_s=0.0, probe_s=0.1, interval_s=0.01, leave=left.append)
    watch.start()
    while len(calls) < 3 * len(script):  # many looks at the final state
        assert watch.is_alive(), left
        watch.join(timeout=0.01)
    assert watch.is_alive() and left == [], left
    assert watch._codes == {(100, "2000"): 0}
    watch.stop.set()
    watch.join(timeout=5)


def _probes(answers: list[bool]) -> tuple[list[float], object]:
    """A ``reachable`` that gives ``answers`` in turn (then the last one), recording each call."""
    times: list[float] = []

    def fake(*_: object) -> bool:
        times.append(time.monotonic())
        return answers[min(len(times) - 1, len(answers) - 1)]

    return times, fake


def test_while_the_agent_may_restart_a_store_silent_for_a_few_probes_keeps_it(
    reap: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--max-restarts 1``: the workers failed and the agent is about to rendezvous again; the
    store misses three probes, then answers: the agent restarts (the watch does not end it)."""
    times, fake = _probes([False, False, False, True])
    monkeypatch.setattr(agent_watch, "reachable", fake)
    left: list[int] = []
    watch = AgentWatch("127.0.0.1", 1, grace_s=0.0, probe_s=0.1, interval_s=0.01, max_restarts=1,
                       store_timeout_s=60.0, leave=left.append)  # fmt: skip
    watch.start()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: a worker that runs until the pipe closes, then fails
        os.close(w)
        os.read(r, 1)
        os._exit(75)
    os.close(r)
    reap.append(pid)
    while watch.generations < 1:  # the watch saw it running: the first generation
        assert watch.is_alive()
        watch.join(timeout=0.01)
    os.close(w)
    while len(times) < 8:  # three silent probes, then many answered
        assert watch.is_alive(), left
        watch.join(timeout=0.01)
    assert watch.is_alive() and left == [], left
    watch.stop.set()
    watch.join(timeout=5)


def test_a_store_silent_for_the_rendezvous_timeout_ends_the_agent(
    reap: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same restart with a store that never answers again: the agent leaves with the
    workers' code once the store was silent for the timeout (torch's ``read_timeout``), not
    at its first missed probe."""
    times, fake = _probes([False])
    monkeypatch.setattr(agent_watch, "reachable", fake)
    left: list[int] = []
    watch = AgentWatch("127.0.0.1", 1, grace_s=0.0, probe_s=0.1, interval_s=0.01, max_restarts=1,
                       store_timeout_s=0.5, leave=left.append)  # fmt: skip
    watch.start()
    reap.append(_worker(75))
    watch.join(timeout=30)
    assert not watch.is_alive() and left == [75]
    assert len(times) > 1 and times[-1] - times[0] >= 0.5, "left before the store was silent for the timeout"


def test_the_store_timeout_is_torchs_read_timeout() -> None:
    assert read_timeout_s("") == 60.0  # torch's default (c10d_rendezvous_backend.py)
    assert read_timeout_s("is_host=false,read_timeout=5") == 5.0
    assert read_timeout_s("read_timeout=x") == 60.0 and read_timeout_s("read_timeout=0") == 60.0
