"""Elastic runs under ``torchrun --nnodes=MIN:MAX`` (docs/elastic.md): :func:`run`
(``python -m lightning_preempt.torchrun``: torchrun with a scheduler's exit codes, a resize
that does not hang, stores bound to the address clients use), :func:`serve_store` (the
rendezvous store on a node that stays), :func:`bound_tcp_store` and :func:`trainer_kwargs`.
The checkpoint path does not change: after a resize every worker resumes, resharded by DCP.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_preempt.agent_watch import AgentWatch, read_timeout_s
from lightning_preempt.collective.heartbeat import route_source
from lightning_preempt.preemption.requeue import AGENT_REQUEUES, requeue_slurm
from lightning_preempt.storage.local import write_atomic

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["ElasticEnv", "bound_tcp_store", "exit_code_for", "listen_socket", "run", "serve_store", "trainer_kwargs"]

#: Widens the address the rendezvous store of a ``run`` agent binds (e.g. ``0.0.0.0``).
ENV_BIND_HOST = "LP_RDZV_BIND_HOST"
_ALL_INTERFACES = ("", "0.0.0.0", "::", "*")


@dataclasses.dataclass(frozen=True)
class ElasticEnv:
    """What torchrun tells one worker about this (re)start."""

    world_size: int
    local_world_size: int
    rank: int
    group_rank: int
    restart_count: int
    max_restarts: int
    run_id: str

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> ElasticEnv | None:
        """The worker's view, or None when not started by torchrun (no ``TORCHELASTIC_RUN_ID``)."""
        env = os.environ if environ is None else environ
        if "TORCHELASTIC_RUN_ID" not in env or "WORLD_SIZE" not in env:
            return None
        return cls(world_size=int(env["WORLD_SIZE"]), local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
                   rank=int(env.get("RANK", "0")), group_rank=int(env.get("GROUP_RANK", "0")),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")), run_id=env["TORCHELASTIC_RUN_ID"])  # fmt: skip


def trainer_kwargs(environ: dict[str, str] | None = None) -> dict[str, int]:
    """``Trainer(**trainer_kwargs())``: ``devices`` and ``num_nodes`` of this (re)start under
    torchrun (the world size changes with every resize); ``{}`` outside torchrun."""
    env = ElasticEnv.from_environ(environ)
    if env is None:
        return {}
    return {"devices": env.local_world_size, "num_nodes": env.num_nodes}


# ---- stores that listen where their clients connect, nowhere else --------------------------
def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``'s address (``0.0.0.0``/``::``/``""``: every interface).

    A name resolving to loopback other than ``localhost`` (Debian's ``127.0.1.1 <hostname>``)
    gets every interface: other nodes reach that name through DNS, at another address.
    """
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # "[::1]"
    if host in _ALL_INTERFACES:
        family, addr = (socket.AF_INET6, "::") if host == "::" else (socket.AF_INET, "0.0.0.0")
    else:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        addr = str(sockaddr[0])
        literal = _is_ip(host)
        if not literal and host != "localhost" and ipaddress.ip_address(addr.split("%")[0]).is_loopback:
            family, addr = socket.AF_INET, "0.0.0.0"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on a fixed port: TIME_WAIT
        if family == socket.AF_INET6 and addr == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" means IPv4 too
        sock.bind((addr, port))
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    return True


def bound_tcp_store(host: str, port: int, *, bind_host: str | None = None, **kwargs: Any) -> TCPStore:
    """A ``TCPStore`` server that listens on ``bind_host`` (default: ``host``'s address) only;
    ``kwargs`` go to ``TCPStore``. (``TCPStore(is_master=True)`` binds every interface; given a
    socket through ``master_listen_fd`` it serves on that one.)"""
    from torch.distributed import TCPStore

    sock = listen_socket(bind_host if bind_host is not None else host, port)
    bound_port = sock.getsockname()[1]
    # The store takes the descriptor over (and closes it): detach, or Python would close it twice.
    fd = sock.detach()
    try:
        return TCPStore(host, bound_port, is_master=True, master_listen_fd=fd, **kwargs)
    except BaseException:
        os.close(fd)
        raise


_TCPSTORE_POSITIONAL = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant")


def _bind_rendezvous_store_to_endpoint() -> None:
    """Make the agent that hosts a rendezvous store bind the address its clients use.

    torch has no option for the bind address, so the c10d and static backends' module name
    ``TCPStore`` is pointed at a factory that hosts through :func:`bound_tcp_store`.
    """
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    def tcp_store(host_name: str, port: int, *args: Any, **kwargs: Any) -> TCPStore:
        named = dict(zip(_TCPSTORE_POSITIONAL, args, strict=False)) | kwargs
        if named.get("is_master") and len(args) <= len(_TCPSTORE_POSITIONAL) and "master_listen_fd" not in named:
            named.pop("is_master")
            try:
                return bound_tcp_store(host_name, port, bind_host=os.environ.get(ENV_BIND_HOST) or None, **named)
            except OSError as err:
                # torch's own store says RuntimeError when the port is taken, and torch falls back
                # to a client on exactly that (another agent of this host hosts it): keep the contract.
                raise RuntimeError(f"cannot host the rendezvous store on {host_name}:{port}: {err}") from err
        return TCPStore(host_name, port, *args, **kwargs)  # type: ignore[misc]

    tcp_store.lightning_preempt_bound = True  # type: ignore[attr-defined]
    for backend in (c10d_rendezvous_backend, static_tcp_rendezvous):
        current = getattr(backend, "TCPStore", None)
        if getattr(current, "lightning_preempt_bound", False):
            continue
        if current is not TCPStore:
            print(f"lightning_preempt.torchrun: this torch builds the stores of {backend.__name__} differently; they "
                  "may listen on every interface", file=sys.stderr, flush=True)  # fmt: skip
            continue
        backend.TCPStore = tcp_store  # type: ignore[attr-defined]


def _host_worker_store_in_agent() -> None:
    """The c10d backend's workers' store (``MASTER_ADDR:MASTER_PORT``): hosted by the agent
    of rendezvous rank 0, bound to ``MASTER_ADDR``'s address, instead of by worker rank 0
    (which, with store sharing off, would listen on every interface). After each round the
    agent hosts a fresh store and its handler says ``use_agent_store``; should the port be
    taken, that round's workers host it as before (noted on stderr).
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    original = DynamicRendezvousHandler.next_rendezvous
    if getattr(original, "lightning_preempt_bound", False):
        return
    agent_store = DynamicRendezvousHandler.use_agent_store

    def next_rendezvous(self: Any) -> Any:
        self._lp_worker_store = None  # the previous round's workers are gone: close their store
        info = original(self)
        where = info.bootstrap_store_info
        if info.rank == 0 and where is not None:
            try:
                self._lp_worker_store = bound_tcp_store(where.master_addr, where.master_port, multi_tenant=True,
                                                        bind_host=os.environ.get(ENV_BIND_HOST) or None)  # fmt: skip
            except (OSError, RuntimeError) as err:
                print(f"lightning_preempt.torchrun: cannot host the workers' store on {where.master_addr}:"
                      f"{where.master_port} ({err}); worker rank 0 hosts it (on every interface)",
                      file=sys.stderr, flush=True)  # fmt: skip
        return info

    def use_agent_store(self: Any) -> bool:
        return getattr(self, "_lp_worker_store", None) is not None or bool(agent_store.fget(self))  # type: ignore[attr-defined]

    next_rendezvous.lightning_preempt_bound = True  # type: ignore[attr-defined]
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    DynamicRendezvousHandler.use_agent_store = property(use_agent_store)  # type: ignore[assignment,method-assign]


def _local_addr_default(args: argparse.Namespace) -> str | None:
    """The agent's ``--local-addr`` when not given, for the c10d backend: the local address
    toward the rendezvous endpoint, so the workers' store binds where its clients connect
    (torch's default, the FQDN, may resolve to anything). ``None``: leave torch's default."""
    endpoint = args.rdzv_endpoint or ""
    local_only = args.standalone or (args.rdzv_backend == "static" and not endpoint and args.master_port is None
                                     and str(args.nnodes).split(":")[-1] == "1")  # fmt: skip
    if args.local_addr or not (local_only or (args.rdzv_backend == "c10d" and endpoint)):
        return None
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        host = "localhost" if local_only else parse_rendezvous_endpoint(endpoint, default_port=29400)[0].strip("[]")
    except ValueError:
        return None
    return route_source(host)


# ---- the launcher --------------------------------------------------------------------------
def exit_code_for(exc: BaseException) -> int:
    """The exit code a scheduler should see for what ended ``torch.distributed.run``:
    ``128 + signal`` for a signalled agent (what Kubernetes and SLURM match on), the first
    failed worker's code for ``ChildFailedError`` (``128 + signal`` if killed), else 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, SignalException):
        return 128 + int(exc.sigval)
    if isinstance(exc, ChildFailedError):
        code = int(exc.get_first_failure()[1].exitcode)
        return 128 - code if code < 0 else code if 0 < code < 256 else 1
    return 1


def run(argv: Sequence[str] | None = None) -> int:
    """``torchrun`` (exactly its arguments) returning 0 when the workers finished, else
    :func:`exit_code_for` of what stopped the agent, with one line naming the cause."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Without this a node joining a running job deadlocks the re-rendezvous (module docstring).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _bind_rendezvous_store_to_endpoint()  # its pickled state must not be reachable wider than needed
    _host_worker_store_in_agent()  # nor the workers' store (MASTER_PORT)
    args = torchrun.parse_args(list(argv) if argv is not None else None)
    args.local_addr = args.local_addr or _local_addr_default(args)
    _watch_store(args)
    slurm_job = os.environ.get("SLURM_JOB_ID")
    if slurm_job is not None:
        # One SLURM job per node: the workers' rank 0 may be on another node, so this agent
        # requeues its own job when it is the one reclaimed (below), and the workers do not.
        os.environ[AGENT_REQUEUES] = "1"
    try:
        torchrun.run(args)
    except (SignalException, ChildFailedError) as exc:
        code = exit_code_for(exc)
        if isinstance(exc, SignalException):
            what = f"the agent received {signal.Signals(exc.sigval).name}"
        else:
            what = f"a worker failed ({exc.get_first_failure()[1].message or 'no error file'})"
        requeue = isinstance(exc, SignalException) and slurm_job is not None
        then = f"; requeueing SLURM job {slurm_job} last" if requeue else ""
        print(f"lightning_preempt.torchrun: {what}; exiting with {code}{then}", file=sys.stderr, flush=True)
        if requeue:
            # The workers have exited (their snapshot committed): the last act, as in the
            # callback's emergency sequence (preemption/requeue.py).
            done = requeue_slurm(str(slurm_job), 10.0, flush=sys.stderr.flush, settle_s=3.0)
            print(f"lightning_preempt.torchrun: {done}", file=sys.stderr, flush=True)
        return code
    return 0


def _watch_store(args: argparse.Namespace) -> None:
    """A c10d rendezvous on another node's store: an agent whose workers exited leaves when
    that store stops answering (agent_watch.py; torch's agent would wait on it for good)."""
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    except ValueError:
        return  # torch reports a bad endpoint itself
    timeout_s = read_timeout_s(args.rdzv_conf or "")
    AgentWatch(host.strip("[]"), port, max_restarts=int(args.max_restarts or 0), store_timeout_s=timeout_s).start()


# ---- a rendezvous store on a node that stays -------------------------------------------------
def serve_store(host: str, port: int, *, ready_file: str | None = None) -> None:
    """Host the c10d rendezvous store until SIGTERM/SIGINT (blocks); agents connect with
    ``--rdzv-endpoint=HOST:PORT --rdzv-conf is_host=false``. ``ready_file`` is written once
    it listens, on ``host``'s address only: whoever connects can run code in the agents."""
    store = bound_tcp_store(host, port, wait_for_workers=False, multi_tenant=True)
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    if ready_file:
        write_atomic(ready_file, str(store.port).encode(), durable=False)  # a reader never sees it half-written
    print(f"lightning_preempt: rendezvous store listening on {host}:{store.port} (no authentication: only "
          "hosts that may run code in the agents should reach this address)", flush=True)  # fmt: skip
    while not stop:
        time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_preempt.elastic")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("store", help="host the c10d rendezvous store (run it on a node that is not preemptible)")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on, the one the agents' --rdzv-endpoint "
                   "names (default 127.0.0.1: this host only; 0.0.0.0: every interface). Whoever reaches it can run "
                   "code in the agents: see docs/elastic.md")  # fmt: skip
    s.add_argument("--port", type=int, default=29400)
    s.add_argument("--ready-file", default=None, help="write the port here once listening")
    args = p.parse_args(argv)
    if args.cmd == "store":
        serve_store(args.host, args.port, ready_file=args.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
