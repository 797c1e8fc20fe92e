"""Several hosts on one machine: Linux network namespaces joined by a bridge (root only).

:class:`Hosts` makes one *switch* namespace holding a bridge, and one namespace per node,
each with a veth pair from its ``eth0`` (an address in 198.18.0.0/24, the RFC 2544 test
range, inside the namespaces only: nothing is added to the host's own network) to a port of
the bridge. Every node has its own network stack: its own loopback, its own ports, its own
routes; processes started with :meth:`Hosts.popen` run inside it. The file system is shared
(like a shared checkpoint store); ``/dev/shm`` too unless a test gives a node its own.

Faults: :meth:`Hosts.kill_node` SIGKILLs every process of a node's namespace (what a power
loss leaves of it), :meth:`Hosts.cut`/:meth:`Hosts.heal` take the node's switch port down and
up (a partition: no reset reaches anyone, packets just stop), :meth:`Hosts.delay` adds
latency with ``tc netem`` (when the kernel has it).

Names are unique per instance (``lp<hex>-<i>``), so pytest-xdist workers never clash;
:meth:`Hosts.close` kills what is left and deletes the namespaces (fixtures call it in their
finalizer). :func:`missing` says in one line why namespaces cannot be used here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from typing import Any

import reaper

SUBNET = "198.18.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def missing() -> str | None:
    """Why network namespaces cannot be used here (``None``: they can)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command is missing (apt-get install iproute2)"
    probe = f"lp{uuid.uuid4().hex[:8]}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def netem_missing(hosts: Hosts) -> str | None:
    """Why ``tc netem`` cannot add latency here (``None``: it can)."""
    if shutil.which("tc") is None:
        return "the `tc` command is missing (apt-get install iproute2)"
    ns = hosts.nodes[0]
    add = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                          "1ms"], capture_output=True, text=True, timeout=30)  # fmt: skip
    if add.returncode != 0:
        return f"tc netem is not available in this kernel: {add.stderr.strip()}"
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True,
                   timeout=30)  # fmt: skip
    return None


class Hosts:
    """``n`` nodes on a bridge (see the module docstring); node ``i`` has address :meth:`ip`."""

    def __init__(self, n: int) -> None:
        tag = uuid.uuid4().hex[:8]
        self.switch = f"lp{tag}-s"
        self.nodes = [f"lp{tag}-{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[Any]] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.nodes):
            _ip("netns", "add", ns)
            # both ends made inside their namespaces: no name ever exists in the host's own
            _ip(
                "link",
                "add",
                "name",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                f"p{i}",
                "netns",
                self.switch,
            )
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    # ---- processes ------------------------------------------------------------------------
    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside node ``i`` (its own session: a kill of the node reaches it anyway)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.nodes[i], *argv], start_new_session=True, **kwargs)
        self.procs.append(proc)
        reaper.track(proc.pid)
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process inside node ``i``'s namespace."""
        out = _ip("netns", "pids", self.nodes[i], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_node(self, i: int) -> int:
        """SIGKILL every process of node ``i`` at once (repeated until none is left); how many."""
        killed = 0
        for _ in range(20):
            pids = self.pids(i)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
            time.sleep(0.05)
        for proc in self.procs:  # reap ours
            if proc.poll() is None and proc.pid not in self.pids(i):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.1)
        return killed

    # ---- the network --------------------------------------------------------------------------
    def cut(self, i: int) -> None:
        """Node ``i``'s switch port goes down: a partition (nothing is reset, packets stop)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def delay(self, i: int, ms: float) -> None:
        """``tc netem`` latency on node ``i``'s ``eth0`` (check :func:`netem_missing` first)."""
        subprocess.run(["ip", "netns", "exec", self.nodes[i], "tc", "qdisc", "replace", "dev", "eth0", "root", "netem",
                        "delay", f"{ms}ms"], check=True, capture_output=True, timeout=30)  # fmt: skip

    # ---- the end --------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill everything inside, delete every namespace (the bridge and the veths go with them)."""
        for i in range(len(self.nodes)):
            with contextlib.suppress(Exception):
                self.kill_node(i)
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
        for ns in [*self.nodes, self.switch]:
            _ip("netns", "del", ns, check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
