"""Simulated nodes for the elastic tests: real torchrun agents on this one machine.

Each "node" is one ``python -m lightning_preempt.torchrun`` agent (one worker, gloo on
CPU) in a session of its own; they meet through the c10d rendezvous on a store hosted by
``python -m lightning_preempt.elastic store`` on 127.0.0.1 (off the "preemptible" nodes,
as docs/elastic.md recommends). A preemption is a SIGTERM to one agent, as Kubernetes sends
it to a container's PID 1. The worker (``elastic_script.py``) writes what the tests assert
on into ``status/`` (see its docstring).

The store, the agents and the workers the agents start are forked from the zygote (zygote.py,
``jobs.Job``: torch and Lightning imported once) instead of fresh interpreters, each leading a
process group of its own as ``start_new_session`` would; ``LP_ZYGOTE=0`` starts interpreters.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import jobs
import reaper

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "elastic_script.py"

# Fast resizes: a dead node is dropped after 1 s x 3 missed keep-alives; a complete round
# waits 1 s for latecomers (docs/elastic.md, "Settings that make a resize fast").
RDZV_CONF = "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=300"


class Cluster:
    """A rendezvous store and named agents; :meth:`close` ends every process it started."""

    def __init__(
        self,
        tmp: Path,
        *,
        nnodes: str = "1:2",
        max_restarts: int = 3,
        script_args: tuple[str, ...] = (),
        url_prefix: str = "",
    ) -> None:
        self.tmp = tmp
        self.status = tmp / "status"
        self.dirpath = tmp / "ckpt"  # on local disk; the workers see url_prefix + this path
        self.url = f"{url_prefix}{self.dirpath}"
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        self.script_args = script_args
        self.run_id = uuid.uuid4().hex[:12]
        self.agents: dict[str, Any] = {}  # subprocess.Popen or jobs.Job
        self.store: Any = None
        self.port = 0

    # ---- processes -------------------------------------------------------------------------
    def start_store(self, timeout: float = 60) -> None:
        ready = self.tmp / "store.port"
        argv = ["-m", "lightning_preempt.elastic", "store", "--host", "127.0.0.1", "--port", "0",
                "--ready-file", str(ready)]  # fmt: skip
        self.store = self._popen(argv, dict(os.environ), self.tmp / "store.log")
        deadline = time.monotonic() + timeout
        while not ready.exists():
            assert self.store.poll() is None, (self.tmp / "store.log").read_text()
            assert time.monotonic() < deadline, "the rendezvous store did not start"
            time.sleep(0.1)
        self.port = int(ready.read_text())

    def command(self, name: str, launcher: str = "wrapper", extra: tuple[str, ...] = ()) -> list[str]:
        head = (
            [sys.executable, "-m", "lightning_preempt.torchrun"]
            if launcher == "wrapper"
            else [sys.executable, "-m", "torch.distributed.run"]
        )
        return [
            *head,
            f"--nnodes={self.nnodes}", "--nproc-per-node=1", f"--max-restarts={self.max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={RDZV_CONF}", "--monitor-interval=0.2", "--shutdown-timeout=60",
            str(SCRIPT), "--dirpath", self.url, "--status", str(self.status), "--name", name,
            *self.script_args, *extra,
        ]  # fmt: skip

    def start(self, name: str, *, launcher: str = "wrapper", env: dict[str, str] | None = None,
              extra: tuple[str, ...] = ()) -> None:  # fmt: skip
        # The package of this checkout (a worktree's), not the one installed in the venv.
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), str(ROOT)]), **(env or {})}
        self.agents[name] = self._popen(self.command(name, launcher, extra)[1:], full_env,
                                        self.tmp / f"{name}.agent.log")  # fmt: skip

    @staticmethod
    def _popen(argv: list[str], env: dict[str, str], log_path: Path) -> Any:
        """``python argv…`` in ROOT, in a process group of its own, its output appended to ``log_path``."""
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            if jobs.USE_ZYGOTE:
                proc: Any = jobs.Job(argv, ROOT, env, out_fd=log.fileno())
            else:
                proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        reaper.track(proc.pid)  # with its workers (in sessions of their own)
        return proc

    def preempt(self, name: str, sig: int = signal.SIGTERM) -> None:
        """The node's grace period starts: its agent (the container's PID 1) gets ``sig``."""
        self.agents[name].send_signal(sig)

    def wait(self, name: str, timeout: float = 240) -> int:
        try:
            return self.agents[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {name} still running after {timeout}s\n{self.log(name)}") from None

    def kill_node(self, name: str) -> None:
        """The node vanishes without a signal: its agent and its current worker get SIGKILL
        (torchrun starts workers in sessions of their own, so both are named)."""
        self._kill_worker(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.agents[name].pid, signal.SIGKILL)
        self.agents[name].wait(timeout=30)

    def _kill_worker(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int((self.status / f"{name}.pid").read_text()), signal.SIGKILL)

    def close(self) -> None:
        for name, proc in self.agents.items():
            if proc.poll() is None:
                self._kill_worker(name)  # only while its agent runs: the pid is then ours
        for proc in [*self.agents.values(), self.store]:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the agent's own session
                proc.wait(timeout=30)

    # ---- what the workers reported ------------------------------------------------------------
    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.agent.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        keep = [ln for ln in lines if "Warning" not in ln and "warnings.warn" not in ln]
        return "\n".join(keep[-60:])

    def step(self, name: str) -> int:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int((self.status / f"{name}.step").read_text())
        return -1

    def _poll(self, names: str, done: Any, what: Any, timeout: float) -> Any:
        """Poll ``done()`` until it returns something other than ``None`` (returned); fail with
        ``what()`` after ``timeout`` s, or at once when an agent of ``names`` exited."""
        deadline = time.monotonic() + timeout
        while (got := done()) is None:
            for name in names:
                proc = self.agents[name]
                assert proc.poll() is None, f"agent {name} exited with {proc.returncode}\n{self.log(name)}"
            assert time.monotonic() < deadline, f"{what()}\n{self.log(names[0])}"
            time.sleep(0.1)
        return got

    def wait_step(self, name: str, step: int, timeout: float = 180) -> int:
        return int(self._poll(name, lambda: now if (now := self.step(name)) >= step else None,
                              lambda: f"node {name} did not reach step {step}", timeout))  # fmt: skip

    def records(self, name: str, kind: str) -> list[dict[str, Any]]:
        """The worker starts (``kind="start"``) or exits (``"exit"``) of a node, in time order."""
        out = [json.loads(p.read_text()) for p in self.status.glob(f"{name}.*.{kind}.json")]
        return sorted(out, key=lambda r: r["time"])

    def wait_world(self, names: str, size: int, timeout: float = 180) -> int:
        """Wait until every node of ``names`` started workers in a world of ``size`` nodes; the
        step they started at. (A rendezvous closes 1 s after its minimum joined, and an agent
        started late under load joins a round later: every node restarts then, at ``size``.)"""

        def started() -> int | None:
            starts = [[r for r in self.records(n, "start") if r["world_size"] == size] for n in names]
            return max(r[-1]["start_step"] for r in starts) if all(starts) else None

        return int(self._poll(names, started, lambda: f"no world of {size} nodes {names}", timeout))

    def wait_starts(self, name: str, n: int, timeout: float = 180) -> list[dict[str, Any]]:
        return list(self._poll(name, lambda: starts if len(starts := self.records(name, "start")) >= n else None,
                               lambda: f"node {name}: {len(self.records(name, 'start'))} starts, waited for {n}",
                               timeout))  # fmt: skip
