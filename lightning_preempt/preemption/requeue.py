"""Requeueing the job with SLURM's ``scontrol``, bounded in time (measured: SLURM 22.05).

``scontrol requeue`` ends the run at once (SIGTERM to every task), so it is the emergency
sequence's last act and the SIGTERM it brings is absorbed for a few seconds: the process
still exits with its own code. SLURM requeues even a cancelled job, so one SLURM is ending
is not requeued (:func:`ended_by_slurm`). Under our torchrun the agent requeues instead.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

#: Set by ``lightning_preempt.torchrun`` under SLURM for its workers: the agent requeues the
#: job of the node that received the signal, so ``requeue=None`` does not requeue in a worker.
AGENT_REQUEUES = "LIGHTNING_PREEMPT_AGENT_REQUEUES"


def _seconds(duration: str) -> int | None:
    """SLURM's ``[D-]HH:MM:SS`` / ``MM:SS`` as seconds; ``None`` for ``UNLIMITED`` and the like."""
    days, _, clock = duration.rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        return int(days or 0) * 86400 + sum(v * 60**i for i, v in enumerate(reversed(parts)))
    except ValueError:
        return None


def ended_by_slurm(job: str, timeout_s: float) -> str | None:
    """Why SLURM is already ending ``job`` for good, or ``None``. A cancelled job shows as
    ``COMPLETING`` like one at its time limit; only the run time tells them apart."""
    try:
        result = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                                timeout=timeout_s, check=False)  # fmt: skip
    except (subprocess.TimeoutExpired, OSError):
        return None
    fields = dict(t.partition("=")[::2] for t in result.stdout.split() if "=" in t)
    state = fields.get("JobState")
    if state not in ("COMPLETING", "CANCELLED"):
        return None
    limit, ran = _seconds(fields.get("TimeLimit", "")), _seconds(fields.get("RunTime", ""))
    if state == "COMPLETING" and limit is not None and ran is not None and ran >= limit:
        return None  # the time limit's kill: requeue, as a preemption
    return (f"{state} before its time limit (scancel; the batch shell's death, e.g. by `--signal=B:...`; "
            "or SLURM's own requeue)")  # fmt: skip


def requeue_slurm(
    job: str, timeout_s: float, *, flush: Callable[[], None] | None = None, settle_s: float = 0.0
) -> str:
    """``scontrol requeue JOB``, bounded; returns what happened (never raises). ``flush`` runs
    just before (SLURM's kill follows); ``settle_s``: then absorb SLURM's SIGTERM (main thread)."""
    if shutil.which("scontrol") is None:
        return "requeue requested but `scontrol` is not on PATH; the scheduler decides"
    begun = time.monotonic()
    ended = ended_by_slurm(job, min(2.0, timeout_s / 2))  # within timeout_s, with the requeue
    if ended is not None:
        return f"SLURM job {job} is {ended}: not requeueing it (`scontrol requeue {job}` brings it back)"
    if flush is not None:
        flush()
    absorb = settle_s > 0 and threading.current_thread() is threading.main_thread()
    with _sigterm_noted(absorb) as wait:
        try:
            result = subprocess.run(
                ["scontrol", "requeue", job], capture_output=True, text=True,
                timeout=max(0.5, timeout_s - (time.monotonic() - begun)), check=False
            )
        except subprocess.TimeoutExpired:
            return f"scontrol requeue {job} did not answer within {timeout_s:.1f}s; exiting without it"
        except OSError as err:
            return f"scontrol requeue {job} could not run: {err}"
        done = f"scontrol requeue {job} -> exit {result.returncode} {result.stderr.strip()}".rstrip()
        if result.returncode != 0 or not absorb:
            return done
        came = wait(settle_s)
    if came is not None:
        return f"{done}; SLURM's SIGTERM came {came:.2f}s later (absorbed: the process exits by itself)"
    return f"{done}; no SIGTERM from SLURM within {settle_s:.1f}s"


def absorb_requeue_term(job: str, settle_s: float, *, flush: Callable[[], None] | None = None) -> str:
    """On a rank that does not requeue: absorb, up to ``settle_s``, the SIGTERM another rank's
    requeue brings (main thread; not when :func:`ended_by_slurm`)."""
    if settle_s <= 0 or threading.current_thread() is not threading.main_thread():
        return "not waiting for SLURM's SIGTERM (no time left, or not the main thread)"
    with _sigterm_noted() as wait:
        if shutil.which("scontrol") is not None and ended_by_slurm(job, min(2.0, settle_s)) is not None:
            return f"SLURM job {job} is ending for good: not waiting for a requeue's SIGTERM"
        if flush is not None:
            flush()
        came = wait(settle_s)
    if came is not None:
        return f"SLURM's SIGTERM after the requeue came {came:.2f}s later (absorbed on this rank too)"
    return f"no SIGTERM from SLURM within {settle_s:.1f}s on this rank"


@contextlib.contextmanager
def _sigterm_noted(active: bool = True) -> Iterator[Callable[[float], float | None]]:
    """Inside the block a SIGTERM is only noted (main thread; nothing changes unless ``active``).
    Yields ``wait(settle_s)``: the seconds from the block's start to the first SIGTERM, waiting
    up to ``settle_s`` for one; ``None`` when none came."""
    came: list[float] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: came.append(time.monotonic())) if active else None
    start = time.monotonic()

    def wait(settle_s: float) -> float | None:
        while not came and time.monotonic() - start < settle_s:
            time.sleep(0.02)
        return came[0] - start if came else None

    try:
        yield wait
    finally:
        if active:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
