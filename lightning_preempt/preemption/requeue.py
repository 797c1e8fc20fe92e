"""Requeueing the job with the scheduler (SLURM's ``scontrol``), bounded in time.

Measured under SLURM 22.05 (tests/e2e/test_slurm.py): ``scontrol requeue`` of the job a
process runs in makes SLURM end that run at once (SIGCONT, SIGTERM to every task, SIGKILL
after ``KillWait``). So the requeue is the emergency sequence's last act, after its log lines
are flushed, and the SIGTERM it brings is absorbed here (a handler that only notes it) for a
few seconds, so the process still exits with its own code (143) and SLURM records that, not
"killed by signal 15" in the middle of the teardown (releasing the lease, the saver's threads).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from types import FrameType


def requeue_slurm(
    job: str, timeout_s: float, *, flush: Callable[[], None] | None = None, settle_s: float = 0.0
) -> str:
    """``scontrol requeue JOB``, bounded; returns what happened (never raises).

    Args:
        job: the SLURM job id (``$SLURM_JOB_ID``).
        timeout_s: the longest ``scontrol`` may take.
        flush: called right before the requeue (flush the logs: SLURM's kill follows).
        settle_s: after a successful requeue, wait up to this long for SLURM's SIGTERM, with a
            handler that only notes it (main thread only; elsewhere nothing is waited for).
    """
    if shutil.which("scontrol") is None:
        return "requeue requested but `scontrol` is not on PATH; the scheduler decides"
    if flush is not None:
        flush()
    absorb = settle_s > 0 and threading.current_thread() is threading.main_thread()
    came: list[float] = []

    def note(signum: int, frame: FrameType | None) -> None:
        came.append(time.monotonic())

    previous = signal.signal(signal.SIGTERM, note) if absorb else None
    try:
        start = time.monotonic()
        try:
            result = subprocess.run(
                ["scontrol", "requeue", job], capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return f"scontrol requeue {job} did not answer within {timeout_s:.1f}s; exiting without it"
        except OSError as err:
            return f"scontrol requeue {job} could not run: {err}"
        done = f"scontrol requeue {job} -> exit {result.returncode} {result.stderr.strip()}".rstrip()
        if result.returncode != 0 or not absorb:
            return done
        while not came and time.monotonic() - start < settle_s:
            time.sleep(0.02)
        if came:
            return f"{done}; SLURM's SIGTERM came {came[0] - start:.2f}s later (absorbed: the process exits by itself)"
        return f"{done}; no SIGTERM from SLURM within {settle_s:.1f}s"
    finally:
        if absorb:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
