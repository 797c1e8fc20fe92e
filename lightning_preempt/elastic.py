"""Elastic runs under ``torchrun --nnodes=MIN:MAX``: what the package adds around torchrun.

Nothing in the checkpoint path changes for an elastic run: after a resize torchrun starts
every worker again at the new world size, and the callback resumes from the newest valid
checkpoint, resharded by DCP (docs/elastic.md). What torchrun itself gets wrong for a
preemptible cluster, and what this module provides:

* **The exit code.** An agent that receives SIGTERM forwards it to its workers (which
  snapshot and exit 143), then re-raises ``SignalException`` out of ``torch.distributed.run``'s
  ``main``: the interpreter exits **1**, so a scheduler cannot tell a preemption from a
  crash. :func:`run` (``python -m lightning_preempt.torchrun``) is torchrun with the exit
  code a scheduler expects: ``128 + signal`` when the agent was signalled, the failed
  worker's own exit code when the workers failed (143 after a preemption snapshot).
* **A rendezvous store off the preemptible nodes.** With the c10d backend the agent whose
  address matches ``--rdzv-endpoint`` hosts the store; when that node is reclaimed the
  whole job goes with it. :func:`serve_store` (``python -m lightning_preempt.elastic store``)
  hosts it on a node that stays (a login node, a small CPU pod); agents then pass
  ``--rdzv-conf is_host=false``.
* **A node that joins a running job hangs the resize** (torch 2.13, c10d rendezvous with the
  TCP store shared with the workers, the default): an agent that was rank 0 before keeps
  its bootstrap store info and does not publish ``MASTER_ADDR`` for the new round, while
  the joining agent (not rank 0) waits for it; both time out in ``DistStoreError``.
  :func:`run` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set), which makes
  rank 0 publish it in every round (the workers then get their own store on rank 0's node).
* **The Trainer's shape.** Lightning checks ``devices * num_nodes == WORLD_SIZE``;
  :func:`trainer_kwargs` reads both from torchrun's environment on every (re)start.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Sequence

__all__ = ["ElasticEnv", "exit_code_for", "run", "serve_store", "trainer_kwargs"]


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
        return cls(
            world_size=int(env["WORLD_SIZE"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            rank=int(env.get("RANK", "0")),
            group_rank=int(env.get("GROUP_RANK", "0")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
            run_id=env["TORCHELASTIC_RUN_ID"],
        )


def trainer_kwargs(environ: dict[str, str] | None = None) -> dict[str, int]:
    """``Trainer(**trainer_kwargs())``: ``devices`` and ``num_nodes`` of this (re)start.

    Under torchrun the world size changes with every resize, while Lightning insists that
    ``devices * num_nodes`` equals it; outside torchrun this returns ``{}`` (Lightning's
    defaults apply).
    """
    env = ElasticEnv.from_environ(environ)
    if env is None:
        return {}
    return {"devices": env.local_world_size, "num_nodes": env.num_nodes}


# ---- the launcher --------------------------------------------------------------------------
def exit_code_for(exc: BaseException) -> int:
    """The exit code a scheduler should see for what ended ``torch.distributed.run``.

    ``SignalException`` (the agent was sent SIGTERM/SIGINT/…): ``128 + signal``, as if the
    agent had died of it, the convention schedulers match on (Kubernetes
    ``podFailurePolicy``, SLURM). ``ChildFailedError``: the first failed worker's exit code
    (a worker killed by a signal: ``128 + signal``). Anything else: 1.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, SignalException):
        return 128 + int(exc.sigval)
    if isinstance(exc, ChildFailedError):
        _, failure = exc.get_first_failure()
        code = int(failure.exitcode)
        if code < 0:
            return 128 + (-code)
        return code if 0 < code < 256 else 1
    return 1


def run(argv: Sequence[str] | None = None) -> int:
    """``torchrun`` with scheduler-friendly exit codes (see the module docstring).

    Takes exactly torchrun's arguments. Returns 0 when the workers finished, else
    :func:`exit_code_for` of what stopped the agent; the traceback torchrun would have
    printed is replaced by one line naming the cause.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Without this a node joining a running job deadlocks the re-rendezvous (module docstring).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = torchrun.parse_args(list(argv) if argv is not None else None)
    try:
        torchrun.run(args)
    except (SignalException, ChildFailedError) as exc:
        code = exit_code_for(exc)
        what = (
            f"the agent received {signal.Signals(exc.sigval).name}"  # type: ignore[union-attr]
            if isinstance(exc, SignalException)
            else f"a worker failed ({exc.get_first_failure()[1].message or 'no error file'})"  # type: ignore[union-attr]
        )
        print(f"lightning_preempt.torchrun: {what}; exiting with {code}", file=sys.stderr, flush=True)
        return code
    return 0


# ---- a rendezvous store on a node that stays -------------------------------------------------
def serve_store(host: str, port: int, *, ready_file: str | None = None) -> None:
    """Host the c10d rendezvous store until SIGTERM/SIGINT (blocks).

    Agents connect with ``--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-conf
    is_host=false`` and keep their rendezvous state here, so the loss of any training node
    leaves the rendezvous intact. ``ready_file`` is written once the store listens.
    """
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(ready_file + ".tmp", ready_file)
    print(f"lightning_preempt: rendezvous store listening on {host}:{store.port}", flush=True)
    while not stop:
        time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_preempt.elastic")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("store", help="host the c10d rendezvous store (run it on a node that is not preemptible)")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=29400)
    s.add_argument("--ready-file", default=None, help="write the port here once listening")
    args = p.parse_args(argv)
    if args.cmd == "store":
        serve_store(args.host, args.port, ready_file=args.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
