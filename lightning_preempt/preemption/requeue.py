"""Requeueing the job with the scheduler (SLURM's ``scontrol``), bounded in time.
"""

from __future__ import annotations

import shutil
import subprocess


def requeue_slurm(job: str, timeout_s: float) -> str:
    """``scontrol requeue JOB``, bounded; returns what happened (never raises)."""
    if shutil.which("scontrol") is None:
        return "requeue requested but `scontrol` is not on PATH; the scheduler decides"
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return f"scontrol requeue {job} did not answer within {timeout_s:.1f}s; exiting without it"
    except OSError as err:
        return f"scontrol requeue {job} could not run: {err}"
    return f"scontrol requeue {job} -> exit {result.returncode} {result.stderr.strip()}".rstrip()

