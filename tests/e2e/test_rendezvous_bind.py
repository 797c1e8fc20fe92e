"""Who can reach the rendezvous stores: real processes, real sockets, the kernel's own table.

torch's ``TCPStore`` has no authentication and the c10d rendezvous state in it is a pickle
the joining agents load, so the store must listen on the address its clients use, nothing
wider. Each test reads ``/proc/net/tcp{,6}`` for the port (what ``ss -ltn`` shows) and,
where this machine has a non-loopback address, connects through it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]


def listeners(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (``::`` = every interface)."""
    found: set[str] = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                addr, hexport = fields[1].split(":")
                if int(hexport, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, packed))
    return found


def listening_sockets(session: int) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket listening in the processes of ``session``
    (what ``ss -ltnp`` shows for their pids): sockets found by inode in ``/proc/PID/fd``."""
    inodes: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3]) != session:
                continue
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found: set[tuple[str, int]] = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:
                    continue
                addr, hexport = fields[1].split(":")
                raw = bytes.fromhex(addr)
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, packed), int(hexport, 16)))
    return found


def other_address() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one (no packet is sent)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # routing only: UDP connect sends nothing
        addr = str(s.getsockname()[0])
        if not addr.startswith("127."):
            return addr
    return None


def reachable(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


@contextlib.contextmanager
def store_process(tmp: Path, *args: str) -> Iterator[int]:
    ready = tmp / "store.port"
    log = tmp / "store.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_preempt.elastic", "store", "--port", "0", "--ready-file", str(ready), *args],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the store did not start"
            time.sleep(0.05)
        yield int(ready.read_text())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("args", [(), ("--host", "127.0.0.1")], ids=["default", "loopback"])
def test_the_store_listens_on_loopback_only(tmp_path: Path, args: tuple[str, ...]) -> None:
    from torch.distributed import TCPStore

    with store_process(tmp_path, *args) as port:
        assert listeners(port) == {"127.0.0.1"}  # was {"::"}: every interface, whatever --host said
        other = other_address()
        if other is not None:
            assert not reachable(other, port)
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        client.set("k", b"v")  # and it is a working store on the address it names
        assert client.get("k") == b"v"


def test_host_0_0_0_0_widens_the_store_to_every_interface(tmp_path: Path) -> None:
    with store_process(tmp_path, "--host", "0.0.0.0") as port:
        assert listeners(port) == {"0.0.0.0"}
        other = other_address()
        if other is not None:
            assert reachable(other, port)


WORKER = """
import os, sys, time
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo")  # worker rank 0 hosts the workers' store on MASTER_PORT
out = Path(sys.argv[1])
(out / "master_port.tmp").write_text(os.environ["MASTER_PORT"])
os.replace(out / "master_port.tmp", out / "master_port")
deadline = time.monotonic() + 120
while not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("widen", [None, "0.0.0.0"], ids=["endpoint", "LP_RDZV_BIND_HOST"])
def test_an_agent_hosting_a_loopback_rendezvous_listens_on_loopback_only(tmp_path: Path, widen: str | None) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        rdzv_port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "lightning_preempt.torchrun", "--nnodes=1", "--nproc-per-node=1",
           "--max-restarts=0", "--monitor-interval=0.1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", "--rdzv-id=bind-test", str(script), str(tmp_path)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LP_RDZV_BIND_HOST"}
    if widen is not None:
        env["LP_RDZV_BIND_HOST"] = widen  # the explicit way to widen it
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "master_port").exists():
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        # The agent (inferred is_host: the endpoint is this machine) hosts the rendezvous store.
        assert listeners(rdzv_port) == {widen or "127.0.0.1"}, (tmp_path / "agent.log").read_text()[-4000:]
        other = other_address()
        if other is not None:
            assert reachable(other, rdzv_port) == (widen is not None)
        master_port = int((tmp_path / "master_port").read_text())
        # The workers' store (MASTER_PORT): hosted by the agent, bound like the rendezvous store
        # (was {"::"}: created by worker rank 0 inside init_process_group, every interface).
        assert listeners(master_port) == {widen or "127.0.0.1"}, (tmp_path / "agent.log").read_text()[-4000:]
        if other is not None:
            assert reachable(other, master_port) == (widen is not None)
        # Every listening socket of the run's processes (agent and worker): none on a wildcard
        # address unless widened (gloo's own listener included).
        sockets = listening_sockets(agent.pid)
        assert {rdzv_port, master_port} <= {port for _, port in sockets}, sockets
        wildcard = {(a, p) for a, p in sockets if a in ("0.0.0.0", "::")}
        assert wildcard == ({(widen, rdzv_port), (widen, master_port)} if widen else set()), sockets
        (tmp_path / "go").touch()
        assert agent.wait(timeout=120) == 0, (tmp_path / "agent.log").read_text()[-4000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_the_static_backend_store_listens_on_the_master_address_only(tmp_path: Path) -> None:
    """``--rdzv-backend=static``: rank 0's agent hosts one store, for the rendezvous and the
    workers alike, on ``--master-port``: bound to ``--master-addr`` (was every interface)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "lightning_preempt.torchrun", "--nnodes=1", "--nproc-per-node=1",
           "--max-restarts=0", "--monitor-interval=0.1", "--rdzv-backend=static", "--node-rank=0",
           "--master-addr=127.0.0.1", f"--master-port={master_port}", str(script), str(tmp_path)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LP_RDZV_BIND_HOST"}
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "master_port").exists():
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        assert int((tmp_path / "master_port").read_text()) == master_port
        assert listeners(master_port) == {"127.0.0.1"}, (tmp_path / "agent.log").read_text()[-4000:]
        sockets = listening_sockets(agent.pid)
        assert not {(a, p) for a, p in sockets if a in ("0.0.0.0", "::")}, sockets
        (tmp_path / "go").touch()
        assert agent.wait(timeout=120) == 0, (tmp_path / "agent.log").read_text()[-4000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.slow  # a 2-rank fit each (~11 s): CI samples them; LP_FULL=1 runs both
@pytest.mark.parametrize("bound", [False, True], ids=["lightning-ddp", "bound-store-recipe"])
def test_lightnings_ddp_launcher_store_listens_everywhere_unless_hosted_bound(tmp_path: Path, bound: bool) -> None:
    """Lightning's own DDP launcher (no torchrun): rank 0 creates the ``MASTER_PORT`` store
    inside ``init_process_group``, on every interface, whatever ``MASTER_ADDR`` says;
    docs/elastic.md's recipe (the launching process hosts it through ``bound_tcp_store``)
    keeps it, and every socket of the job, on loopback."""
    cmd = [sys.executable, str(ROOT / "tests" / "support" / "ddp_bind_script.py"), str(tmp_path)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1"}  # not enough: the store ignores it
    env.pop("MASTER_PORT", None)
    if bound:
        cmd.append("--bound-store")
    with open(tmp_path / "job.log", "wb") as log:
        job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "master_port").exists():
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the fit did not reach step 2"
            time.sleep(0.05)
        master_port = int((tmp_path / "master_port").read_text())
        sockets = listening_sockets(job.pid)
        wildcard = {(a, p) for a, p in sockets if a in ("0.0.0.0", "::")}
        assert wildcard == (set() if bound else {("::", master_port)}), sockets
        other = other_address()
        if other is not None:
            assert reachable(other, master_port) == (not bound)
        (tmp_path / "go").touch()
        assert job.wait(timeout=120) == 0, (tmp_path / "job.log").read_text()[-4000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
