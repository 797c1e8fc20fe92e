"""Lightning's ``FSDPStrategy`` (FSDP1) through the plugin: every rank writes its own shard,
committed; the agreed SIGTERM snapshot; resume bit-identical, resharded, and past a damaged
newest checkpoint. Real processes: 2 ranks on CPU over gloo (tests/support/cpu_fsdp.py)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import assert_same, flip_byte
from jobs import launch
from test_sharded import _bytes_per_rank

from lightning_preempt import list_checkpoints
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.storage.store import Store

pytestmark = pytest.mark.multiproc


def _run(tmp: Path, name: str, *extra: str, devices: int = 2, strategy: str = "fsdp", code: int = 0) -> dict[int, Any]:
    """One fit into ``tmp/ck``; its status in ``tmp/name`` (its output in ``name.log``); each
    rank's result (a normal end)."""
    status = tmp / name
    tmp.mkdir(exist_ok=True)
    args = ["--dirpath", str(tmp / "ck"), "--status", str(status), "--every", "5", "--width", "64"]
    args += ["--devices", str(devices), "--strategy", strategy, *extra]
    proc = launch("train_script.py", tmp, *args)
    out, _ = proc.communicate(timeout=300)
    (tmp / f"{name}.log").write_text(out)
    assert proc.returncode == code, out[-5000:]
    for rank in range(devices):
        assert (status / f"rank{rank}.exit").read_text() == str(code), out[-3000:]
    if code:
        return {}
    return {r: json.loads((status / f"rank{r}.result.json").read_text()) for r in range(devices)}


def _committed(tmp: Path) -> list[Any]:
    return [c for c in list_checkpoints(str(tmp / "ck")) if c.committed]


@pytest.mark.parametrize("state_dict_type", ["fsdp", pytest.param("fsdp_full", marks=pytest.mark.slow)])
def test_sigterm_on_one_rank_snapshots_every_shard_and_resumes_bit_identical(tmp_path: Path, state_dict_type: str) -> None:
    reference = _run(tmp_path / "ref", "st", "--max-steps", "20", strategy=state_dict_type)
    assert all(r["step"] == 20 and r["weights"] for r in reference.values())

    _run(tmp_path, "st1", "--max-steps", "20", "--signal-at", "step:12", "--signal-rank", "1",
         strategy=state_dict_type, code=143)  # fmt: skip
    snapshot = _committed(tmp_path)[0]
    assert snapshot.step >= 12 and snapshot.world_size == 2 and snapshot.manifest is not None
    per_rank = _bytes_per_rank(snapshot)
    assert set(per_rank) == {0, 1} and min(per_rank.values()) > 0.25 * sum(per_rank.values()), per_rank
    assert {"state-rank00000.pt", "state-rank00001.pt"} <= set(snapshot.manifest.files)

    resumed = _run(tmp_path, "st2", "--max-steps", "20", strategy=state_dict_type)
    for rank in range(2):
        assert resumed[rank]["start_step"] == snapshot.step
        assert resumed[rank]["resumed_from"].endswith(snapshot.name)
        assert resumed[rank]["weights"] == reference[rank]["weights"]  # each rank's shard, bit for bit


def test_saved_at_2_ranks_resumes_on_1_resharded(tmp_path: Path) -> None:
    _run(tmp_path, "st10", "--max-steps", "10")
    _run(tmp_path, "st12", "--max-steps", "12", "--dump-start", str(tmp_path / "start12"), devices=1)
    saved = load_full_checkpoint(Store(str(tmp_path / "ck" / "step-0000000010")))
    started = torch.load(f"{tmp_path / 'start12'}.rank0", weights_only=False)
    assert_same(dict(saved["state_dict"]), started["weights"])
    saved_state = saved["optimizer_states"][0]["state"]
    start_state = started["optim"]["state"]
    assert sorted(saved_state) == sorted(start_state) and len(start_state) == 4
    for key, entry in saved_state.items():
        for name in ("exp_avg", "exp_avg_sq"):  # a fresh AdamW loaded every entry
            torch.testing.assert_close(entry[name], start_state[key][name], rtol=0, atol=0)


@pytest.mark.slow  # CI samples it (tests/conftest.py); LP_FULL=1 runs it
def test_two_tiers_resume_from_the_local_tier_then_from_the_bucket(tmp_path: Path) -> None:
    local = ("--local-dirpath", str(tmp_path / "local"))
    _run(tmp_path, "st10", "--max-steps", "10", *local)
    drained = [c.step for c in _committed(tmp_path)]
    assert drained == [10, 5], (tmp_path / "st10.log").read_text()[-4000:]  # every local commit drained
    resumed = _run(tmp_path, "st12", "--max-steps", "12", *local)
    assert all(r["resumed_from"] == str(tmp_path / "local" / "step-0000000010") for r in resumed.values())
    shutil.rmtree(tmp_path / "local")  # the node-local disk lost with its node
    again = _run(tmp_path, "st14", "--max-steps", "14", *local)
    assert all(r["start_step"] == 12 and r["resumed_from"].endswith("ck/step-0000000012") for r in again.values())


@pytest.mark.slow
def test_tier0_a_sigkilled_pair_resumes_from_host_memory(tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"lp-test-fsdp1-{uuid.uuid4().hex[:12]}"
    tier0 = ("--cb-kwargs", json.dumps({"tier0_every_n_steps": 2, "tuning": {"memory_dirpath": str(shm)}}))
    try:
        status = tmp_path / "st1"
        args = ["--dirpath", str(tmp_path / "ck"), "--status", str(status), "--every", "5", "--width", "64",
                "--devices", "2", "--strategy", "fsdp", "--max-steps", "20", *tier0,
                "--signal-at", "saved-kill:12", "--signal-rank", "0"]  # fmt: skip
        proc = launch("train_script.py", tmp_path, *args)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0 and [c.step for c in list_checkpoints(str(shm)) if c.committed] == [12], out[-3000:]
        resumed = _run(tmp_path, "st2", "--max-steps", "20", *tier0)
        assert all(r["start_step"] == 12 and r["resumed_from"] == str(shm / "step-0000000012") for r in resumed.values())
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_damaged_newest_falls_back_to_the_one_before(tmp_path: Path) -> None:
    _run(tmp_path, "st10", "--max-steps", "10")
    newest = _committed(tmp_path)[0]
    assert newest.step == 10
    shard = next(n for n in newest.manifest.files if n.endswith(".distcp"))
    flip_byte(tmp_path / "ck" / newest.name / shard)
    resumed = _run(tmp_path, "st12", "--max-steps", "12")
    assert [r["start_step"] for r in resumed.values()] == [5, 5]
    assert all(r["resumed_from"].endswith("step-0000000005") for r in resumed.values())


def _fabric(tmp: Path, name: str, *extra: str, expect: int = 0) -> tuple[list[dict[str, Any]], str]:
    """One run of fabric_script.py (a hand-written loop under ``Preemption``) with FSDP1."""
    status = tmp / name
    args = ["--dirpath", str(tmp / "ck"), "--status", str(status), "--devices", "2", "--every", "5", *extra]
    proc = launch("fabric_script.py", tmp, *args)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == expect, out[-5000:]
    results = [(status / f"rank{r}.result.json") for r in range(2)]
    return [json.loads(p.read_text()) if p.exists() else {} for p in results], out


@pytest.mark.slow  # CI samples it (tests/conftest.py); LP_FULL=1 runs it
def test_fabric_fsdp1_preempted_on_one_rank_resumes_and_ends_bit_identical(tmp_path: Path) -> None:
    (tmp_path / "straight").mkdir()
    expected, _ = _fabric(tmp_path / "straight", "st", "--strategy", "fsdp")
    assert expected[0]["step"] == 24 and expected[0]["weights"]
    _fabric(tmp_path, "st1", "--strategy", "fsdp", "--signal-at", "9", "--signal-rank", "1", expect=143)
    snapshot = _committed(tmp_path)[0]
    assert snapshot.step >= 9 and snapshot.world_size == 2
    assert set(_bytes_per_rank(snapshot)) == {0, 1}
    resumed, _ = _fabric(tmp_path, "st2", "--strategy", "fsdp")
    for rank in range(2):
        assert resumed[rank]["start_step"] == snapshot.step and resumed[rank]["step"] == 24
        assert resumed[rank]["weights"] == expected[rank]["weights"]


def test_fabric_fsdp1_without_a_device_mesh_is_refused_before_step_1(tmp_path: Path) -> None:
    _, out = _fabric(tmp_path, "st", "--strategy", "fsdp_no_mesh", expect=1)
    assert "HINT: pass device_mesh=(num_nodes, devices_per_node) and sharding_strategy='HYBRID_SHARD'" in out
    assert not (tmp_path / "st" / "rank0.step").exists()  # not one step trained
    assert _committed(tmp_path) == []
