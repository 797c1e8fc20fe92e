"""DeepSpeed ZeRO-3 on 2 CPU ranks over gloo (tests/support/deepspeed_cpu.py lifts Lightning's
CUDA checks; test-only), under the PreemptionCallback: DeepSpeed's own per-rank files become
committed checkpoints. Needs DeepSpeed: run in .venv-ds (scripts/_venv_deepspeed.sh,
docs/testing.md); skipped where it is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpts import committed, flip_byte
from jobs import launch

from lightning_preempt.format.manifest import Manifest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.multiproc

RANK_FILES = [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]


def _run(tmp: Path, name: str, *extra: str, max_steps: int = 20) -> tuple[int, str]:
    status = tmp / f"st-{name}"
    args = ["--dirpath", str(tmp / "ck"), "--status", str(status), "--max-steps", str(max_steps), *extra]
    proc = launch("deepspeed_script.py", tmp, *args)
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def _result(tmp: Path, name: str) -> dict:
    return json.loads((tmp / f"st-{name}" / "rank0.result.json").read_text())


def _manifest(tmp: Path, step: int) -> Manifest:
    path = tmp / "ck" / f"step-{step:010d}"
    return Manifest.from_json((path / "manifest.json").read_bytes(), path=str(path))


def _exits(tmp: Path, name: str) -> list[int]:
    return [int((tmp / f"st-{name}" / f"rank{r}.exit").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_sigterm_on_rank1_commits_every_ranks_files_and_resumes_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    code, out = _run(reference, "a")
    assert code == 0, out[-4000:]

    code, out = _run(tmp_path, "a", "--every", "1000", "--signal-at", "step:9", "--signal-rank", "1")
    assert code == 143 and _exits(tmp_path, "a") == [143, 143], out[-4000:]
    snapshot = committed(tmp_path / "ck")[0]
    assert snapshot >= 9, out[-4000:]
    manifest = _manifest(tmp_path, snapshot)
    assert sorted(manifest.files) == sorted(RANK_FILES) and manifest.world_size == 2
    for name, entry in manifest.files.items():  # the files listed are the files on disk
        assert (tmp_path / "ck" / f"step-{snapshot:010d}" / name).stat().st_size == entry.size
    assert f"safe to resume from: step {snapshot} (" in out, out[-4000:]  # the exit log knows it

    code, out = _run(tmp_path, "b", "--every", "1000")
    assert code == 0, out[-4000:]
    assert _result(tmp_path, "b")["start_step"] == snapshot
    assert _result(tmp_path, "b")["step"] == 20
    resumed = torch.load(tmp_path / "st-b" / "weights.pt")
    uninterrupted = torch.load(reference / "st-a" / "weights.pt")
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.slow
def test_a_corrupted_newest_falls_back_to_the_previous_committed(tmp_path: Path) -> None:
    code, out = _run(tmp_path, "a", "--every", "4", max_steps=8)
    assert code == 0, out[-4000:]
    assert committed(tmp_path / "ck") == [8, 4], out[-4000:]
    flip_byte(tmp_path / "ck" / "step-0000000008" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")

    code, out = _run(tmp_path, "b", "--every", "1000", max_steps=10)
    assert code == 0, out[-4000:]
    result = _result(tmp_path, "b")
    assert result["start_step"] == 4 and result["resumed_from"].endswith("step-0000000004"), out[-4000:]
    assert "fails its CRC32C check" in out
