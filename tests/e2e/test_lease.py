"""The lease on a dirpath (issue 20, finding 7), as jobs meet it: real training processes,
real lease files (some planted by someone else), checked by exit codes, steps and files."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
from ckpts import committed
from jobs import launch, step_of, wait_for

from lightning_preempt.format.names import checkpoint_name, lease_name
from lightning_preempt.save.lease import Lease, _valid_record

pytestmark = pytest.mark.multiproc


def _launch(tmp: Path, status: str, *extra: str, cb: dict | None = None) -> subprocess.Popen[str]:
    args = ["--dirpath", str(tmp / "ck"), "--status", str(tmp / status), *extra]
    return launch("train_script.py", tmp, *args, "--cb-kwargs", json.dumps(cb or {}))


def _plant(tmp: Path, generation: int, record: dict | bytes) -> Path:
    (tmp / "ck").mkdir(exist_ok=True)
    path = tmp / "ck" / f".lp-lease-{generation:010d}.json"
    path.write_bytes(record if isinstance(record, bytes) else json.dumps(record).encode())
    return path


@pytest.mark.slow  # two jobs, one after the other: ~20 s (DDP: ~40 s)
@pytest.mark.parametrize(("ranks", "strategy"), [(1, "auto"), (2, "ddp"), (2, "model_parallel")],
                         ids=["1rank", "ddp2", "model_parallel2"])  # fmt: skip
def test_a_job_that_waited_for_the_lease_resumes_what_the_holder_committed_meanwhile(
    tmp_path: Path, ranks: int, strategy: str
) -> None:
    # The holder beats every 15 s: the waiter watches a silent lease until it is released.
    lease = {"tuning": {"lease_timeout_s": 60.0}}
    # model_parallel restores after its own set-up: the late load happens in on_fit_start
    job = ["--every", "60", "--devices", str(ranks), "--strategy", strategy]
    first = _launch(tmp_path, "st1", "--max-steps", "60", "--step-sleep", "0.1", *job, cb=lease)
    wait_for(first, "step 3", lambda: (step_of(tmp_path / "st1") or 0) >= 3, timeout=90)
    # Its first checkpoint comes at step 60: the second job's peek sees none, then it waits.
    second = _launch(tmp_path, "st2", "--max-steps", "80", *job, cb=lease)
    out1, _ = first.communicate(timeout=120)
    out2, _ = second.communicate(timeout=180)
    assert first.returncode == 0, out1[-3000:]
    assert second.returncode == 0, out2[-3000:]
    assert "taking over the lease" in out2 and "released by its holder" in out2
    for rank in range(ranks):  # every rank loaded it
        result = json.loads((tmp_path / "st2" / f"rank{rank}.result.json").read_text())
        assert result["start_step"] == 60 and result["step"] == 80  # was 0: it trained from scratch
        assert result["resumed_from"] == str(tmp_path / "ck" / checkpoint_name(60))
    names = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-"))
    assert names == [checkpoint_name(60), checkpoint_name(80)]  # no step-60-<suffix> from a second run
    assert committed(tmp_path / "ck") == [80, 60]


def test_a_lease_at_the_last_generation_is_refused_by_every_job(tmp_path: Path) -> None:
    # Planted, released: before, a job took generation 10**10 (an 11-digit name nobody sees)
    # and deleted this one, so the next live job took generation 1: two holders.
    planted = _plant(tmp_path, 9_999_999_999, {"released": True, "heartbeat_unix": time.time()})
    first = _launch(tmp_path, "st1", "--max-steps", "400", "--every", "50", "--step-sleep", "0.05")
    out1, _ = first.communicate(timeout=120)
    second = _launch(tmp_path, "st2", "--max-steps", "400", "--every", "50", "--step-sleep", "0.05")
    out2, _ = second.communicate(timeout=120)
    for proc, out, status in ((first, out1, "st1"), (second, out2, "st2")):
        assert proc.returncode not in (0, None), out[-3000:]
        assert "LeaseHeldError" in out and "generation 9999999999" in out and "HINT: If no other job" in out
        assert step_of(tmp_path / status) is None  # not a single step trained
    assert planted.exists() and sorted(p.name for p in (tmp_path / "ck").glob(".lp-lease-*")) == [planted.name]


# ---- planted lease files, read by the job that takes the lease (real files, no training) --
def test_a_lease_with_an_impossible_pid_goes_stale_instead_of_crashing(tmp_path: Path) -> None:
    _plant(tmp_path, 1, {"pid": 10**20, "host": socket.gethostname(), "heartbeat_unix": time.time(),
                         "released": False, "token": "x"})  # fmt: skip
    lease = Lease(str(tmp_path / "ck"), timeout_s=0.5)
    lease.acquire(poll_s=0.1)  # was: OverflowError from os.kill
    assert lease.generation == 2
    assert json.loads((tmp_path / "ck" / lease_name(2)).read_text())["token"] == lease.token


def test_an_8_gib_lease_file_is_refused_unread(tmp_path: Path) -> None:
    path = _plant(tmp_path, 1, b"")
    with open(path, "r+b") as f:
        f.truncate(8 << 30)  # sparse: no disk used, but reading it all needs 8 GiB of memory
    lease = Lease(str(tmp_path / "ck"), timeout_s=0.5)
    lease.acquire(poll_s=0.1)  # was: MemoryError (or 8 GiB allocated)
    assert lease.generation == 2 and not path.exists()  # damaged, silent: taken over after the timeout


def test_a_lease_record_keeps_only_well_formed_fields() -> None:
    planted = {"pid": True, "heartbeat_unix": float("inf"), "released": "yes", "job": "\x1b]0;pwned\x07" + "j" * 999,
               "host": 7, "token": "t"}  # fmt: skip
    record = _valid_record(planted)
    assert record == {"job": "?]0;pwned?" + "j" * 190, "token": "t"}  # no pid, no heartbeat: goes stale
    assert _valid_record({"pid": 2**22 - 1, "heartbeat_unix": 5, "released": False})["pid"] == 2**22 - 1
    assert "pid" not in _valid_record({"pid": 2**22}) and _valid_record([1, 2]) == {}
