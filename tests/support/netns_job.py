"""A real multi-node training job on :class:`netns.Hosts`: one torchrun agent per node.

Each node runs ``python -m lightning_preempt.torchrun`` (one worker, gloo on CPU over the
node's ``eth0``) with the c10d rendezvous on node 0's address; the worker is
``train_script.py`` (TinyModel, ``PreemptionCallback`` with its default failure detection:
on for more than one rank). The checkpoint directory is shared (the file system is), like
shared storage. :class:`NodeJob` launches the nodes, reports each worker's step, pid and
exit, and the agents' exit codes; one instance per launch (a restart is a new launch, as a
scheduler makes it). Used by tests/multihost/ and benchmarks/bench_node_loss.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from netns import Hosts
from procs import RankFiles, wait_gone

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = Path(__file__).resolve().parent / "train_script.py"
PORT = 29400
RDZV_CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


class NodeJob(RankFiles):
    """One launch of the job on ``nodes`` of ``hosts`` (node ``nodes[0]`` hosts the rendezvous).

    Args:
        work: the run's directory (``ckpt/`` inside is ``dirpath``, shared by every launch).
        script_args: more ``train_script.py`` arguments (``--max-steps``, ``--every``…).
        memory: each node's own tier-0 memory (the namespaces share the machine's
            ``/dev/shm``): node ``i``'s agent runs with ``memory/node{i}`` bind-mounted on
            ``memory/tier0`` in its own mount namespace, so ``memory_dirpath=memory/tier0``
            is one path on every node with node-local contents, as on real hosts.
    """

    def __init__(self, hosts: Hosts, work: Path, nodes: list[int], script_args: list[str], *,
                 env: dict[str, str] | None = None, memory: Path | None = None) -> None:  # fmt: skip
        self.hosts, self.work, self.nodes = hosts, work, nodes
        self.tag = uuid.uuid4().hex[:8]
        super().__init__(work / f"launch-{self.tag}", len(nodes))
        self.status.mkdir(parents=True)
        self.dirpath = work / "ckpt"
        self.agents: dict[int, subprocess.Popen[bytes]] = {}
        host = hosts.ip(nodes[0])
        for node in nodes:
            cmd = [
                sys.executable, "-m", "lightning_preempt.torchrun", f"--nnodes={len(nodes)}", "--nproc-per-node=1",
                "--max-restarts=0", "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{PORT}", f"--rdzv-id={self.tag}",
                f"--rdzv-conf={RDZV_CONF},is_host={str(node == nodes[0]).lower()}", f"--local-addr={hosts.ip(node)}", "--monitor-interval=0.2",
                str(SCRIPT), "--dirpath", str(self.dirpath), "--status", str(self.status),
                "--num-nodes", str(len(nodes)), "--strategy", "ddp", *script_args,
            ]  # fmt: skip
            full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), str(ROOT)]),
                        "GLOO_SOCKET_IFNAME": "eth0", "LP_ZYGOTE": "0", **(env or {})}  # fmt: skip
            if memory is not None:  # `ip netns exec` gives every agent a mount namespace of its own
                own, shared = memory / f"node{node}", memory / "tier0"
                cmd = ["sh", "-c", 'mkdir -p "$1" "$2" && mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
                       str(own), str(shared), *cmd]  # fmt: skip
            with open(self.status / f"node{node}.log", "ab") as log:
                self.agents[node] = hosts.popen(node, cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)

    # ---- what the workers report (rank = position in ``nodes``: one worker per node): RankFiles
    def wait_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while min(self.step(r) for r in range(len(self.nodes))) < step:
            for node, proc in self.agents.items():
                assert proc.poll() is None, f"node {node} exited with {proc.returncode}\n{self.log(node)}"
            assert time.monotonic() < deadline, f"step {step} not reached\n{self.log(self.nodes[0])}"
            time.sleep(0.05)

    def wait_gone(self, ranks: list[int], timeout: float = 60) -> float | None:
        """Seconds until every worker of ``ranks`` is gone (``None``: still there after ``timeout``)."""
        return wait_gone([p for p in (self.pid(r) for r in ranks) if p is not None], timeout)

    def wait(self, timeout: float = 240) -> dict[int, int | None]:
        """Every agent's exit code (``None``: still running after ``timeout``; then killed)."""
        deadline = time.monotonic() + timeout
        out: dict[int, int | None] = {}
        for node, proc in self.agents.items():
            try:
                out[node] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out[node] = None
        return out

    def log(self, node: int) -> str:
        path = self.status / f"node{node}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(ln for ln in lines[-80:] if "warn" not in ln.lower())

