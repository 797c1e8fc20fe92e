"""Two real processes saving to one checkpoint path at the same moment (issue 20, finding 6).

Each worker is a separate process (``multiprocessing`` forkserver: forked from a server that
imported torch and the plugin once, instead of two fresh interpreters paying ~4 s of imports
each; ``LP_RANKS_START=spawn``: spawned, as ranks.py) holding its own
:class:`ShardedAsyncCheckpointIO` without any lease, as ``ModelCheckpoint`` with the plugin
or two jobs sharing a dirpath would. Per trial the parent names a fresh step directory and
a start time; each worker sleeps until then (plus its delay), saves its own checkpoint
(its own ``global_step`` and tensors) and reports what it was told. The parent then reads
what is committed at the path, CRC32C-verified, and compares it with the checkpoint of the
writer that was told "committed": anything else is *committed but corrupt*.

Used by ``tests/unit/test_concurrent_commit.py`` (a few trials) and
more trials by hand (``run_trials(root, delays)`` with 30 delays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import time
from typing import Any

START_METHOD = os.environ.get("LP_RANKS_START", "forkserver")
#: What the writers import, once, in the forkserver (ranks.py preloads the same when it starts
#: that server first: one server per process serves both).
PRELOAD = ["torch", "torch.distributed", "lightning_preempt.lightning.checkpoint_io", "concurrent_saves"]

#: Each writer's checkpoint: enough bytes that the two writes overlap for a while.
WIDTH = 1024
LAYERS = 8


def make_checkpoint(step: int) -> dict[str, Any]:
    """A Lightning-shaped dict (training started: the async sharded path) whose tensors
    depend on ``step``, so whose checkpoint is committed can be told from the bytes."""
    import torch

    gen = torch.Generator().manual_seed(step)
    state = {f"layers.{i}.weight": torch.randn(WIDTH, WIDTH, generator=gen) for i in range(LAYERS)}
    moments = {i: {"exp_avg": torch.randn(WIDTH, WIDTH, generator=gen)} for i in range(LAYERS)}
    return {
        "epoch": 0,
        "global_step": step,
        "state_dict": state,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"started": 1}}}},
        "optimizer_states": [{"state": moments, "param_groups": [{"lr": 0.1, "params": list(range(LAYERS))}]}],
    }


def _worker(conn: Any, scratch: str) -> None:
    """One writer process: for every ``(path, step, start_at)`` received, save at ``start_at``.

    One plugin for all trials, warmed up by a save to ``scratch`` (job thread started, staging
    buffers allocated), so both writers reach their saves within a millisecond or two of
    ``start_at`` and the two writes overlap."""
    import logging

    logging.disable(logging.WARNING)  # the loser's failure is reported through the pipe
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(make_checkpoint(0), scratch)
    io.wait()
    conn.send("ready")
    while (job := conn.recv()) is not None:
        path, step, start_at = job
        checkpoint = make_checkpoint(step)
        time.sleep(max(0.0, start_at - time.time()))
        try:
            io.save_checkpoint(checkpoint, path)
            io.wait()
            conn.send(("committed", ""))
        except Exception as err:
            conn.send(("failed", f"{type(err).__name__}: {err}"))
    with contextlib.suppress(Exception):
        io.teardown()


@dataclasses.dataclass
class Trial:
    """What one trial ended with."""

    delay_s: float
    told: tuple[str, str]  # per writer: "committed" / "failed"
    messages: tuple[str, str]
    committed_step: int | None  # the step of what verifies at the path (None: nothing loads)
    steps: tuple[int, int]
    error: str = ""  # why the committed checkpoint does not load, if it does not

    @property
    def winners(self) -> int:
        return self.told.count("committed")

    @property
    def losers_told(self) -> int:
        """Writers that failed with the message that another writer committed first."""
        return sum(t == "failed" and "another writer committed" in m for t, m in zip(self.told, self.messages))

    @property
    def replaced(self) -> bool:
        """Both told "committed": the second planned after the first's commit and replaced
        it, as any save over a committed checkpoint does (sequential, not concurrent)."""
        return self.winners == 2

    @property
    def corrupt(self) -> bool:
        """A writer was told "committed", yet what is at the path does not verify, or is not
        bit for bit the checkpoint of a writer told "committed"."""
        won = [s for t, s in zip(self.told, self.steps) if t == "committed"]
        return bool(won) and self.committed_step not in won


def _read_committed(path: str, steps: tuple[int, int]) -> tuple[int | None, str]:
    """The step of the checkpoint at ``path`` after a full CRC32C verification and a
    bitwise comparison of its tensors with that writer's checkpoint."""
    import torch

    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
    from lightning_preempt.read.verify import verify_checkpoint
    from lightning_preempt.storage.store import Store

    try:
        verify_checkpoint(Store(path))
        io = ShardedAsyncCheckpointIO()
        loaded = io.load_checkpoint(path)
        io.teardown()
    except Exception as err:
        return None, f"{type(err).__name__}: {str(err).splitlines()[0]}"
    step = int(loaded["global_step"])
    if step not in steps:
        return None, f"unknown step {step}"
    expected = make_checkpoint(step)["state_dict"]
    if any(not torch.equal(loaded["state_dict"][k], v) for k, v in expected.items()):
        return None, f"step {step}'s tensors are not its writer's (a mix of two saves)"
    return step, ""


def _commit_first(path: str, step: int) -> None:
    """A committed checkpoint at ``path`` before the trial (the writers then replace it)."""
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(make_checkpoint(step), path)
    io.teardown()


def run_trials(root: str, delays: list[float], *, replace: bool = False) -> list[Trial]:
    """One trial per delay (seconds the second writer starts after the first), each in a
    fresh ``root/trial-N/step-0000000100`` directory, with two writer processes.
    ``replace``: the directory already holds a committed checkpoint, which both replace
    (``last.ckpt`` saved by two processes): both may be told "committed"."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # (no effect once this process's server runs)
    pipes, procs = [], []
    for writer in range(2):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, os.path.join(root, f"warm-up-{writer}")), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    trials = []
    try:
        for conn in pipes:
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError("a writer process did not start")
        for n, delay in enumerate(delays):
            path = os.path.join(root, f"trial-{n:03d}", "step-0000000100")
            steps = (1000 * n + 1, 1000 * n + 2)
            if replace:
                _commit_first(path, 1000 * n)
            start_at = time.time() + 0.3
            for writer, conn in enumerate(pipes):
                conn.send((path, steps[writer], start_at + (delay if writer else 0.0)))
            outcomes = []
            for conn in pipes:
                if not conn.poll(120):
                    raise RuntimeError("a writer process did not answer within 120 s")
                outcomes.append(conn.recv())
            committed_step, error = _read_committed(path, steps)
            trials.append(Trial(delay, (outcomes[0][0], outcomes[1][0]), (outcomes[0][1], outcomes[1][1]),
                                committed_step, steps, error))  # fmt: skip
    finally:
        for conn in pipes:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return trials
