"""Tier 0 (docs/tier0.md): real training processes copying to a tmpfs every 2 steps, killed
with SIGKILL (no signal, no snapshot), restarted: the resume comes from host memory at the
tier-0 step, or from the disk tier when the newest tier-0 copy is torn.

Disk saves every 5 steps, tier 0 every 2 (a step the disk tier saves is not copied again):
killed after step 12's tier-0 copy committed, the disk tier holds 10 and 5, tier 0 holds 12
(its newest only: the previous copy is removed once the next committed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpts import committed
from jobs import launch, read

from lightning_preempt.cli.commands.cmd_report import build_report
from lightning_preempt.tiers.tier0 import WARMUP_STEPS

pytestmark = pytest.mark.multiproc

MAX_STEPS = 20


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory on the tmpfs, removed afterwards (tier 0's memory_dirpath)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    root = Path("/dev/shm") / f"lp-test-tier0-{uuid.uuid4().hex[:12]}"
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _fit(tmp: Path, shm: Path | None, *extra: str) -> tuple[int, str]:
    args = ["--dirpath", str(tmp / "ck"), "--status", str(tmp / "st"), "--max-steps", str(MAX_STEPS), "--every", "5"]
    if shm is not None:
        args += ["--cb-kwargs", json.dumps({"tier0_every_n_steps": 2, "tuning": {"memory_dirpath": str(shm)}})]
    proc = launch("train_script.py", tmp, *args, *extra)
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def _killed_at_12(tmp: Path, shm: Path) -> None:
    code, out = _fit(tmp, shm, "--signal-at", "saved-kill:12")
    assert code == -signal.SIGKILL, out[-3000:]
    assert committed(tmp / "ck") == [10, 5], out[-3000:]
    assert committed(shm) == [12], out[-3000:]  # retention keeps tier 0's newest


def _result(tmp: Path) -> dict[str, object]:
    text = read(tmp / "st" / "rank0.result.json")
    assert text is not None
    result: dict[str, object] = json.loads(text)
    return result


def _ledger_tiers(tmp: Path) -> list[object]:
    tiers = []
    for path in sorted((tmp / "ck" / ".lp-ledger").rglob("*.json")):
        record = json.loads(path.read_text())
        if record.get("kind") == "start":
            tiers.append(record.get("resumed_tier", record.get("data", {}).get("resumed_tier")))
    return tiers


def test_a_sigkilled_fit_resumes_from_host_memory(tmp_path: Path, shm: Path) -> None:
    _killed_at_12(tmp_path, shm)
    code, out = _fit(tmp_path, shm)
    assert code == 0, out[-3000:]
    result = _result(tmp_path)
    assert result["start_step"] == 12 and result["step"] == MAX_STEPS, out[-3000:]
    assert str(result["resumed_from"]).startswith(str(shm) + "/"), result
    assert os.path.basename(str(result["resumed_from"])) == "step-0000000012"
    # the report: the kill (no signal, no record) resumed from tier 0, the newest tier-0 step
    summary = build_report(str(tmp_path / "ck"), {})
    [kill] = summary["preemptions"]
    assert kill["kind"] == "killed" and kill["resumed_step"] == 12 and kill["resumed_tier"] == "memory", kill
    assert summary["tier0"]["newest_step"] >= 12 and summary["tier0"]["failed"] == 0, summary["tier0"]


@pytest.mark.slow
def test_the_resume_from_memory_is_bit_identical_to_an_uninterrupted_fit(tmp_path: Path, shm: Path) -> None:
    whole = tmp_path / "whole"
    whole.mkdir()
    code, out = _fit(whole, None)
    assert code == 0, out[-3000:]
    _killed_at_12(tmp_path, shm)
    code, out = _fit(tmp_path, shm)
    assert code == 0, out[-3000:]
    resumed = _result(tmp_path)
    assert resumed["start_step"] == 12
    assert resumed["weights"] == _result(whole)["weights"]
    assert _ledger_tiers(tmp_path)[-1] == "memory"


@pytest.mark.slow
def test_a_torn_tier0_copy_falls_back_to_the_disk_tier(tmp_path: Path, shm: Path) -> None:
    _killed_at_12(tmp_path, shm)
    newest = shm / "step-0000000012"
    biggest = max((p for p in newest.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:  # torn: the bytes of a copy that stopped half-way
        f.truncate(biggest.stat().st_size // 2)
    code, out = _fit(tmp_path, shm)
    assert code == 0, out[-3000:]
    result = _result(tmp_path)
    # tier 0 holds no other copy: the disk tier's newest (10) is resumed
    assert result["start_step"] == 10, out[-3000:]
    assert result["resumed_from"] == str(tmp_path / "ck" / "step-0000000010")
    assert "step-0000000012" in out and "skipping checkpoint" in out


@pytest.mark.slow
def test_ddp_ranks_resume_together_from_host_memory(tmp_path: Path, shm: Path) -> None:
    """Two ranks on one host (gloo): each writes its share into the same tier-0 directory."""
    ddp = ("--devices", "2", "--strategy", "ddp")
    code, out = _fit(tmp_path, shm, *ddp, "--signal-at", "saved-kill:12", "--signal-rank", "0")
    assert code != 0 and committed(shm) == [12], out[-3000:]
    assert {p.name for p in (shm / "step-0000000012").iterdir()} >= {"state-rank00000.pt", "state-rank00001.pt"}
    code, out = _fit(tmp_path, shm, *ddp)
    assert code == 0, out[-3000:]
    for rank in (0, 1):
        text = read(tmp_path / "st" / f"rank{rank}.result.json")
        assert text is not None
        result = json.loads(text)
        assert result["start_step"] == 12 and result["step"] == MAX_STEPS
        assert result["resumed_from"] == str(shm / "step-0000000012")


def _tiny_tmpfs_missing() -> str | None:
    """Why a 4 KiB tmpfs cannot be mounted in a private mount namespace here, or ``None``."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    return None if probe.returncode == 0 else f"cannot mount a tmpfs: {probe.stderr.strip()[:200]}"


@pytest.mark.slow
def test_a_full_tmpfs_does_not_stop_training(tmp_path: Path, shm: Path) -> None:
    """Tier 0 on a full tmpfs (4 KiB, mounted in a private mount namespace of the job): every
    copy fails with ENOSPC, is logged with a HINT, and training and the disk tier go on."""
    why = _tiny_tmpfs_missing()
    if why is not None:
        pytest.skip(why)
    shm.mkdir()
    args = ["--dirpath", str(tmp_path / "ck"), "--status", str(tmp_path / "st"), "--max-steps", str(MAX_STEPS),
            "--every", "5", "--width", "256",
            "--cb-kwargs", json.dumps({"tier0_every_n_steps": 2, "tuning": {"memory_dirpath": str(shm)}})]  # fmt: skip
    script = Path(__file__).resolve().parents[1] / "support" / "train_script.py"
    # mode=0700: a tmpfs mounts 1777, which tier 0 refuses as a memory_dirpath (docs/security.md)
    command = f"mount -t tmpfs -o size=4k,mode=0700 tmpfs {shlex.quote(str(shm))} && exec " + shlex.join(
        [sys.executable, str(script), *args]
    )
    proc = subprocess.run(["unshare", "-m", "sh", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "the tier-0 copy to" in out and "HINT: Tier 0 is best effort" in out, out[-3000:]
    assert _result(tmp_path)["step"] == MAX_STEPS
    assert committed(tmp_path / "ck") == [20, 15, 10]
    assert committed(shm) == []  # the mount went with the job's namespace; nothing was committed on the host


def _ledger_records(tmp: Path, kind: str) -> list[dict[str, object]]:
    records = [json.loads(p.read_text()) for p in sorted((tmp / "ck" / ".lp-ledger").rglob("*.json"))]
    return sorted((r for r in records if r.get("kind") == kind), key=lambda r: (r["restart"], r["seq"]))  # type: ignore[arg-type]


@pytest.mark.slow
def test_auto_k_picks_a_k_from_the_measured_copy_and_copies(tmp_path: Path, shm: Path) -> None:
    """``tier0_every_n_steps="auto"`` with a ``memory_dirpath``: the first
    copy after the warm-up measures, the engine logs the K it chose, later copies are K apart
    (or more: a copy starts at an agreement boundary), and each copy is a ledger record that
    the report shows (the newest tier-0 step). 120 steps: a loaded 2-core host measured K ~ 30
    (the writer thread competes with the step for the CPU; that is overhead too)."""
    args = ["--dirpath", str(tmp_path / "ck"), "--status", str(tmp_path / "st"), "--max-steps", "120",
            "--every", "1000", "--step-sleep", "0.05", "--cb-kwargs",
            json.dumps({"tier0_every_n_steps": "auto", "tuning": {"memory_dirpath": str(shm)}})]  # fmt: skip
    proc = launch("train_script.py", tmp_path, *args)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]
    ks = [int(k) for k in re.findall(r"tier 0 copies every (\d+) steps \(auto", out)]
    assert ks and all(k >= 1 for k in ks), out[-3000:]
    copies = [r for r in _ledger_records(tmp_path, "save") if r["tier"] == "memory"]
    steps = [int(r["step"]) for r in copies]  # type: ignore[call-overload]
    assert len(steps) >= 2 and all(r["save_kind"] == "tier0" and r["committed_s"] is not None for r in copies), (steps, ks)
    assert steps[0] > WARMUP_STEPS  # the base step time is measured first
    assert steps[1] - steps[0] >= ks[0], (steps, ks)  # never more often than the first K
    assert committed(shm) == [max(steps)]  # the newest is kept
    report = subprocess.run([sys.executable, "-m", "lightning_preempt.cli", "report", str(tmp_path / "ck")],
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    assert re.search(rf"tier-0 copies\s+{len(steps)}\s+to host memory, newest step {max(steps)}", report.stdout), report.stdout
