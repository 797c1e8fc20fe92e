"""Every rank writes its share; resume at the same and a different world size.

Real processes: DDP and ModelParallelStrategy (FSDP2 `fully_shard`) with 2 ranks on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import assert_same
from jobs import launch

from lightning_preempt import list_checkpoints
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.storage.store import Store

pytestmark = pytest.mark.multiproc


def _run(tmp: Path, devices: int, strategy: str, max_steps: int, dump: str = "") -> None:
    args = ["--dirpath", str(tmp / "ck"), "--status", str(tmp / f"st{max_steps}")]
    args += ["--max-steps", str(max_steps), "--every", "5", "--devices", str(devices), "--strategy", strategy]
    args += ["--width", "512"]  # tensors large enough that per-file overhead does not dominate
    if dump:
        args += ["--dump-start", dump]
    proc = launch("train_script.py", tmp, *args)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-5000:]


def _bytes_per_rank(ckpt: Any) -> dict[int, int]:
    per_rank: dict[int, int] = {}
    for name, entry in ckpt.manifest.files.items():
        if name.startswith("__") and name.endswith(".distcp"):
            rank = int(name[2:].split("_")[0])
            per_rank[rank] = per_rank.get(rank, 0) + entry.size
    return per_rank


def _assert_every_rank_wrote_its_share(tmp: Path, step: int) -> None:
    ckpt = next(c for c in list_checkpoints(str(tmp / "ck")) if c.step == step)
    assert ckpt.committed and ckpt.world_size == 2 and ckpt.manifest is not None
    per_rank = _bytes_per_rank(ckpt)
    total = sum(per_rank.values())
    assert set(per_rank) == {0, 1}
    for rank, nbytes in per_rank.items():
        assert 0.25 * total <= nbytes <= 0.75 * total, (rank, per_rank)
    assert {"state-rank00000.pt", "state-rank00001.pt"} <= set(ckpt.manifest.files)


def _assert_resumed_state_matches(dump: Path, ckpt_dir: Path, ranks: int) -> None:
    saved = load_full_checkpoint(Store(str(ckpt_dir)))
    for rank in range(ranks):
        started = torch.load(f"{dump}.rank{rank}", weights_only=False)
        assert_same(dict(saved["state_dict"]), started["weights"])
        saved_avgs = sorted(float(v["exp_avg"].double().sum()) for v in _optim_states(saved["optimizer_states"][0]))
        start_avgs = sorted(float(v["exp_avg"].double().sum()) for v in _optim_states(started["optim"]))
        assert saved_avgs == start_avgs
        assert len(saved_avgs) == 4


def _optim_states(optim: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    return [
        {k: (t.full_tensor() if hasattr(t, "full_tensor") else t) for k, t in s.items()}
        for s in optim["state"].values()
    ]


def test_ddp_every_rank_writes_and_resumes_at_1_then_2_ranks(tmp_path: Path) -> None:
    _run(tmp_path, 2, "ddp", max_steps=10)
    _assert_every_rank_wrote_its_share(tmp_path, 10)
    _run(tmp_path, 1, "auto", max_steps=12, dump=str(tmp_path / "start12"))
    _assert_resumed_state_matches(tmp_path / "start12", tmp_path / "ck" / "step-0000000010", ranks=1)
    _run(tmp_path, 2, "ddp", max_steps=14, dump=str(tmp_path / "start14"))
    _assert_resumed_state_matches(tmp_path / "start14", tmp_path / "ck" / "step-0000000012", ranks=2)


def test_model_parallel_every_rank_writes_and_resumes_on_one_rank(tmp_path: Path) -> None:
    _run(tmp_path, 2, "model_parallel", max_steps=10)
    _assert_every_rank_wrote_its_share(tmp_path, 10)
    _run(tmp_path, 1, "model_parallel", max_steps=12, dump=str(tmp_path / "start12"))
    _assert_resumed_state_matches(tmp_path / "start12", tmp_path / "ck" / "step-0000000010", ranks=1)
