"""The GPU path (issue 25): pinned staging, staging on a CUDA stream, the overlapped copy,
CUDA RNG in exact resume, the host budget with pinned memory. Marked ``gpu``: skipped
without CUDA (tests/conftest.py); scripts/gpu_check.sh runs them on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.resume.exact_state import capture_rng, restore_rng
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage.store import Store

pytestmark = pytest.mark.gpu
MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the exact-resume harness (run_job, compare)


def _state(n: int = 4, numel: int = MIB // 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return {f"w{i}": torch.randn(numel, device="cuda", generator=gen) for i in range(n)}


def _loaded(url: str) -> dict[str, Any]:
    return load_full_checkpoint(Store(url))


def test_pinned_staging_copies_the_state_at_the_save_exactly(tmp_path: Path) -> None:
    state = _state()
    expected = {k: v.cpu() for k, v in state.items()}
    saver = Saver({})  # pins because CUDA is available
    url = str(tmp_path / "ckpt")
    saver.save({"global_step": 3, "state_dict": state}, SaveOrder(url))
    assert saver.stager._buffers and all(b.is_pinned() for b in saver.stager._buffers.values())
    for t in state.values():
        t.mul_(-1.0)  # the next step, on the GPU, right after the save returned
    saver.close()
    got = _loaded(url)["state_dict"]
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_staging_on_a_side_stream_sees_that_streams_work(tmp_path: Path) -> None:
    """Training (and so the save) on a non-default stream: the copies are queued on the
    current stream, after the kernels that produced the state."""
    side = torch.cuda.Stream()
    saver = Saver({})
    url = str(tmp_path / "ckpt")
    with torch.cuda.stream(side):
        a = torch.randn(2048, 2048, device="cuda")
        state = {"w": a @ a, "v": (a @ a).sum(0)}  # long kernels still queued when the save starts
        saver.save({"global_step": 1, "state_dict": state}, SaveOrder(url))
        expected = {k: v.cpu() for k, v in state.items()}
        state["w"].zero_()
    saver.close()
    got = _loaded(url)["state_dict"]
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_the_overlapped_copy_is_step_k_while_step_k_plus_1_runs_and_resumes_bit_identical(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    def state() -> dict[str, Any]:
        return {"global_step": 2, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}

    step()
    step()
    saver = Saver({}, overlap_staging=True)  # type: ignore[call-arg]
    saver.overlap.stable = lambda: [*model.parameters(), *(v for s in opt.state.values() for v in s.values()
                                                         if torch.is_tensor(v) and v.dim())]  # fmt: skip
    snapshot = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    url = str(tmp_path / "ckpt")
    saver.save(state(), SaveOrder(url))
    step()  # step k+1: forward and backward overlap the copy; its update waits for it
    saver.close()
    got = _loaded(url)
    assert all(torch.equal(got["state_dict"][k], v) for k, v in snapshot.items())
    # resume: a fresh model and optimizer from the checkpoint take step k+1 to the same bits
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)).cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    model2.load_state_dict(got["state_dict"])
    opt2.load_state_dict(got["optimizer_states"][0])
    opt2.zero_grad(set_to_none=True)
    model2(x).pow(2).mean().backward()
    opt2.step()
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in after.items())


def test_cuda_rng_is_captured_and_restored() -> None:
    torch.cuda.init()
    state = capture_rng()
    assert "cuda" in state and len(state["cuda"]) == torch.cuda.device_count()
    a = torch.rand(8, device="cuda")
    restore_rng(state)
    assert torch.equal(a, torch.rand(8, device="cuda"))


def test_exact_resume_on_cuda_replays_the_dropout_masks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact-resume job (dropout draws from the CUDA RNG) preempted twice equals the
    uninterrupted run, bit for bit."""
    from test_exact_resume import COMMON, compare, run_job

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS in both runs
    args = [*COMMON, "--accelerator", "gpu", "--max-steps", "20"]
    run_job([*args, "--dirpath", str(tmp_path / "ref-ckpt")], tmp_path / "ref")
    run_job([*args, "--dirpath", str(tmp_path / "ckpt")], tmp_path / "status", preempt_at=[6, 13])
    compare(tmp_path / "ref", tmp_path / "status")


def test_host_budget_with_pinned_memory_is_exact_and_within_budget(tmp_path: Path) -> None:
    for pinned_cap, chunk_pinned in ((16 * MIB, True), (4 * MIB, False)):
        state = _state(8, MIB)  # 8 x 4 MiB on the GPU: twice the budget
        expected = {k: v.cpu() for k, v in state.items()}
        saver = Saver({}, host_memory_budget=16 * MIB, pinned_memory_budget=pinned_cap)
        url = str(tmp_path / f"ckpt-{pinned_cap}")
        saver.save({"global_step": 5, "state_dict": state}, SaveOrder(url))
        for t in state.values():
            t.add_(1.0)
        saver.close()
        plan = saver.budget.last_split
        assert plan is not None and plan.streamed and plan.chunk_bytes == 4 * MIB
        assert plan.chunk_pinned is chunk_pinned
        assert saver.stager.peak_bytes <= 16 * MIB
        pinned = sum(b.numel() * 4 for b in saver.stager._buffers.values() if b.is_pinned())
        assert pinned + (plan.chunk_bytes if chunk_pinned else 0) <= pinned_cap
        got = _loaded(url)["state_dict"]
        assert all(torch.equal(got[k], v) for k, v in expected.items())
    # and measured in a fresh process: peak RSS (pinned pages are resident) under the budget
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "budget_rss.py"), str(tmp_path / "rss"), "--state-mib", "64",
         "--budget-mib", "32", "--device", "cuda"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got_rss = json.loads(out.stdout.strip().splitlines()[-1])
    assert got_rss["exact"] is True and got_rss["streamed"] > 0 and got_rss["stager_peak"] <= got_rss["budget"]
    assert got_rss["peak_growth"] <= got_rss["budget"] + 2 * MIB, got_rss
