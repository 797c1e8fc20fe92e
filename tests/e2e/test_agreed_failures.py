"""Failures as a user meets them (issue 10): real training processes, real storage failures
(``chaos://``: local disk that fails on command), checked by exit codes, logs and files.

Never a hang, never a silent restart from step 0, a preemption always exits with its code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import chaos_fs
import pytest
from ckpts import committed
from jobs import env_with, launch, step_of, wait_for

from lightning_preempt import list_checkpoints

pytestmark = pytest.mark.multiproc


def _launch(tmp: Path, dirpath: str, *extra: str, cb: dict | None = None, env: dict | None = None,
            status: str = "st") -> subprocess.Popen[str]:  # fmt: skip
    args = ["--dirpath", dirpath, "--status", str(tmp / status), *extra]
    args += ["--cb-kwargs", json.dumps({**(cb or {}), "tuning": {"backoff_s": 0.05, **(cb or {}).get("tuning", {})}})]
    return launch("train_script.py", tmp, *args, env=env_with(LP_CHAOS_DIR=str(tmp / "ctl"), **(env or {})))


def _step(tmp: Path, status: str = "st", rank: int = 0) -> int | None:
    return step_of(tmp / status, rank)


def _wait_step(tmp: Path, proc: subprocess.Popen[str], step: int, status: str = "st", timeout: float = 90) -> int:
    def reached() -> int | None:
        seen = _step(tmp, status)
        return seen if seen is not None and seen >= step else None

    return wait_for(proc, f"step {step}", reached, timeout)


def _first_run(tmp: Path, url: str, steps: int = 10) -> None:
    proc = _launch(tmp, url, "--max-steps", str(steps), "--every", "5", status="first")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


# ---- resume never silently starts over ---------------------------------------------------
def test_a_listing_that_fails_twice_is_retried_and_the_run_resumes(tmp_path: Path) -> None:
    url = f"chaos://{tmp_path}/ck"
    _first_run(tmp_path, url)
    chaos_fs.set_fault(tmp_path / "ctl", "list", times=2)
    proc = _launch(tmp_path, url, "--max-steps", "12", "--every", "5")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    result = json.loads((tmp_path / "st" / "rank0.result.json").read_text())
    assert result["start_step"] == 10 and result["step"] == 12
    assert out.count("retrying in") == 2


def test_a_listing_that_keeps_failing_stops_before_step_1_and_deletes_nothing(tmp_path: Path) -> None:
    url = f"chaos://{tmp_path}/ck"
    _first_run(tmp_path, url)
    before = sorted(c.name for c in list_checkpoints(str(tmp_path / "ck")) if c.committed)
    # a driver error that is not an OSError (google-auth, botocore) is handled alike
    chaos_fs.set_fault(tmp_path / "ctl", "list", exc="RuntimeError")
    proc = _launch(tmp_path, url, "--max-steps", "30", "--every", "5", cb={"tuning": {"retries": 3}})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode not in (0, None), out[-3000:]
    assert "ListingError" in out and "cannot list" in out and "after 3 attempt(s)" in out
    assert "HINT: Training did not start" in out
    assert _step(tmp_path) is None  # not a single step trained from scratch
    chaos_fs.clear_faults(tmp_path / "ctl")
    assert sorted(c.name for c in list_checkpoints(str(tmp_path / "ck")) if c.committed) == before


@pytest.mark.slow
def test_ddp_a_listing_failing_on_rank_1_only_stops_both_ranks_alike(tmp_path: Path) -> None:
    url = f"chaos://{tmp_path}/ck"
    _first_run(tmp_path, url)
    chaos_fs.set_fault(tmp_path / "ctl", "list", ranks=[1])
    proc = _launch(tmp_path, url, "--max-steps", "30", "--devices", "2", "--strategy", "ddp", cb={"tuning": {"retries": 2}})
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode not in (0, None), out[-3000:]
    assert out.count("ListingError: listing dirpath failed on rank 1: cannot list") >= 2  # raised on both ranks
    assert _step(tmp_path, rank=0) is None and _step(tmp_path, rank=1) is None


# ---- a preemption always exits with its code ------------------------------------------
def test_a_snapshot_that_fails_still_exits_143_and_names_the_safe_step(tmp_path: Path) -> None:
    url = f"chaos://{tmp_path}/ck"
    proc = _launch(tmp_path, url, "--max-steps", "2000", "--every", "5", "--step-sleep", "0.02")
    _wait_step(tmp_path, proc, 7)
    for op in ("write", "commit", "makedirs"):
        chaos_fs.set_fault(tmp_path / "ctl", op)  # the storage is gone
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out[-3000:]
    assert "FAILED" in out and "exiting anyway" in out
    safe = out.split("safe to resume from: ")[1].splitlines()[0]
    assert safe.startswith("step ") and int(safe.split()[1]) % 5 == 0 and int(safe.split()[1]) >= 5
    assert (tmp_path / "ck" / f"step-{int(safe.split()[1]):010d}" / "manifest.json").exists()


def test_a_hanging_scontrol_does_not_delay_the_exit_past_its_timeout(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nsleep 60\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    proc = _launch(tmp_path, str(tmp_path / "ck"), "--max-steps", "2000", "--step-sleep", "0.02",
                   env=env)  # fmt: skip
    _wait_step(tmp_path, proc, 3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out[-3000:]
    assert "scontrol requeue 4242 did not answer within 10.0s" in out  # controller.REQUEUE_TIMEOUT_S
    assert time.monotonic() - sent < 25  # 10 s for scontrol, not its 60


# ---- fail fast ----------------------------------------------------------------------
def test_an_unusable_dirpath_fails_at_setup_before_step_1(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    proc = _launch(tmp_path, str(tmp_path / "afile" / "ck"), "--max-steps", "20", "--every", "5")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode not in (0, None)
    assert "the checkpoint storage is not usable" in out and "HINT: Training has not started" in out
    assert _step(tmp_path) is None


def test_a_failed_save_stops_training_within_a_step_or_two(tmp_path: Path) -> None:
    url = f"chaos://{tmp_path}/ck"
    proc = _launch(tmp_path, url, "--max-steps", "2000", "--every", "10", "--step-sleep", "0.03")
    _wait_step(tmp_path, proc, 12)  # step 10 committed
    chaos_fs.set_fault(tmp_path / "ctl", "write")
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode not in (0, None, 143), out[-3000:]
    assert "CheckpointWriteError" in out and "Injected" not in out and "injected: write" in out
    last = _step(tmp_path)
    assert last is not None and 20 <= last <= 22  # the step-20 save failed; stopped at the next boundary or so
    saved = committed(tmp_path / "ck")
    assert 20 not in saved and 10 in saved


# ---- one writer per dirpath ------------------------------------------------------------
def test_a_second_live_job_refuses_and_a_dead_ones_lease_is_taken_over(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    lease = {"tuning": {"lease_timeout_s": 2.0}}
    first = _launch(tmp_path, url, "--max-steps", "5000", "--every", "5", "--step-sleep", "0.02", cb=lease)
    _wait_step(tmp_path, first, 6)
    second = _launch(tmp_path, url, "--max-steps", "5000", "--every", "5", cb=lease, status="st2")
    out, _ = second.communicate(timeout=90)
    assert second.returncode not in (0, None), out[-3000:]
    assert "LeaseHeldError" in out and f"pid {first.pid}" in out and "HINT: Two jobs must not share" in out
    assert _step(tmp_path, "st2") is None and first.poll() is None  # the first job trains on
    first.kill()  # SIGKILL: no release; same host, so its lease is stale at once
    first.communicate(timeout=30)
    third = _launch(tmp_path, url, "--max-steps", "12", "--every", "5", cb=lease, status="st3")
    out, _ = third.communicate(timeout=120)
    assert third.returncode == 0, out[-3000:]
    assert "taking over the lease" in out and f"its process {first.pid} on this host is gone" in out
    result = json.loads((tmp_path / "st3" / "rank0.result.json").read_text())
    resumed_step = int(Path(result["resumed_from"]).name.split("-")[1])  # the first job trained on meanwhile
    assert resumed_step >= 5 and result["step"] == max(12, resumed_step)
    lease_files = sorted(p.name for p in (tmp_path / "ck").glob(".lp-lease-*.json"))
    assert len(lease_files) == 1 and json.loads((tmp_path / "ck" / lease_files[0]).read_text())["released"] is True


# ---- teardown releases everything ---------------------------------------------------------
def test_fit_leaves_no_thread_behind_and_releases_the_lease(tmp_path: Path) -> None:
    from models import TinyModel, loader
    from trainers import make_trainer

    from lightning_preempt import PreemptionCallback

    before = {t.name for t in threading.enumerate()}
    for max_steps in (6, 9):
        cb = PreemptionCallback(str(tmp_path / "ck"), every_n_train_steps=3)
        trainer = make_trainer(max_steps, [cb])
        trainer.fit(TinyModel(), loader(8, batch_size=8))
        assert trainer.global_step == max_steps
    left = {t.name for t in threading.enumerate()} - before
    assert not {n for n in left if n.startswith("lightning_preempt")}, left
    (lease_file,) = (tmp_path / "ck").glob(".lp-lease-*.json")
    assert json.loads(lease_file.read_text())["released"] is True
    assert not list((tmp_path / "ck").glob(".lp-probe-*"))  # the storage probe cleaned up
