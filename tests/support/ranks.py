"""Real ranks for multi-process tests: ``world`` spawned processes, each in one gloo group.

:func:`run_ranks` starts ``worker(rank, world, *args)`` in every rank after
``init_process_group("gloo")`` (a file rendezvous under the test's tmp dir) and waits for
all of them with a deadline: a hang fails the test (the ranks are killed) instead of
holding the suite; a worker's exception fails it with that rank's traceback.

Workers are module-level functions (they are pickled by name into the new processes).
They import what they need themselves and report through files.

The ranks are forked from a forkserver that has imported torch and the package once
(``LP_RANKS_START=spawn``: a fresh interpreter per rank, as before), so a rank starts in a
fraction of a second instead of paying the imports (~2-3 s of CPU) every time. Each rank
gets this process's environment as it is at the call, as a spawned one would. A forked rank
ends with ``os._exit`` after its worker returns (multiprocessing's forkserver does), so an
abort during interpreter shutdown shows only with ``LP_RANKS_START=spawn``.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

START_METHOD = os.environ.get("LP_RANKS_START", "forkserver")
# Imported once in the forkserver, before any thread exists there (forking is then safe).
PRELOAD = ["torch", "torch.distributed", "lightning_preempt.lightning.checkpoint_io", "ranks"]
if START_METHOD == "forkserver":
    mp.set_forkserver_preload(PRELOAD)


def _rank_main(
    rank: int, worker: Callable[..., None], world: int, init_file: str, env: dict[str, str], args: tuple[Any, ...]
) -> None:
    os.environ.clear()  # the caller's environment now, not the forkserver's when it started
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    worker(rank, world, *args)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    worker: Callable[..., None],
    world: int,
    tmp_path: Path,
    *args: Any,
    timeout_s: float = 120,
    exit_codes: Sequence[int] | None = None,
    on_hang: Callable[[], str] = lambda: "",
) -> None:
    """Run ``worker(rank, world, *args)`` on ``world`` ranks; every rank must exit with
    ``exit_codes[rank]`` (default 0) within ``timeout_s``. ``on_hang`` adds to the hang message."""
    init_file = tmp_path / f"gloo-init-{os.getpid()}-{time.monotonic_ns()}"
    ctx = mp.start_processes(
        _rank_main,
        args=(worker, world, str(init_file), dict(os.environ), args),
        nprocs=world,
        join=False,
        start_method=START_METHOD,
    )
    # Each process is waited for here, not with ProcessContext.join(): that one terminates the
    # other ranks as soon as one exits with an error, and a rank dying on purpose is a case.
    deadline = time.monotonic() + timeout_s
    for p in ctx.processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(p.is_alive() for p in ctx.processes):
        for p in ctx.processes:
            p.kill()
        for p in ctx.processes:
            p.join(timeout=30)
        pytest.fail(f"ranks hung (still running after {timeout_s:.0f}s) {on_hang()}".rstrip())
    codes = [p.exitcode for p in ctx.processes]
    expected = list(exit_codes) if exit_codes is not None else [0] * world
    if codes != expected:
        errors = []
        for rank, path in enumerate(ctx.error_files):
            if os.path.exists(path) and os.path.getsize(path):
                with open(path, "rb") as f:
                    errors.append(f"--- rank {rank}:\n{pickle.load(f)}")
        pytest.fail(f"exit codes {codes}, expected {expected}\n" + "\n".join(errors))
