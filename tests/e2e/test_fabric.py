"""A hand-written Fabric loop under ``Preemption`` (lightning_preempt/fabric/), as real
processes: Fabric's ``ddp`` strategy on 2 CPU ranks (gloo), launched by Fabric itself.

Each case checks what a user relies on: both ranks exit with 143 after a SIGTERM to one of
them, the newest committed checkpoint is the step they agreed on, a rerun resumes there
(at 2 ranks or 1), the operator CLI lists, verifies and exports the checkpoint, and after
preemptions at random steps the final weights equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs import launch, read

from lightning_preempt import newest_valid
from lightning_preempt.cli import main as cli

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
STEPS = 24  # 2 epochs of 12 batches per rank (fabric_script.py's data)


def _run(tmp: Path, *extra: str, devices: int = 2, expect: int = 0, status: str = "st") -> list[dict[str, Any]]:
    """One run of fabric_script.py; returns each rank's result (``{}`` when preempted)."""
    st = tmp / status
    st.mkdir(parents=True, exist_ok=True)
    for f in st.glob("rank*"):
        f.unlink()
    args = ["--dirpath", str(tmp / "ck"), "--status", str(st), "--devices", str(devices), *extra]
    proc = launch("fabric_script.py", tmp, *args)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == expect, out[-4000:]
    codes = [read(st / f"rank{r}.exit") for r in range(devices)]
    assert codes == [str(expect)] * devices, (codes, out[-4000:])
    return [json.loads(read(st / f"rank{r}.result.json") or "{}") for r in range(devices)]


def test_sigterm_to_rank1_only_snapshots_one_step_on_both_and_resumes_there(tmp_path: Path) -> None:
    _run(tmp_path, "--signal-at", "7", "--signal-rank", "1", expect=143)
    newest = newest_valid(str(tmp_path / "ck"))
    assert newest is not None and newest.world_size == 2 and newest.step >= 7
    agreed = newest.step
    # the operator tools need nothing Fabric-specific
    assert cli(["ls", str(tmp_path / "ck")]) == 0
    assert cli(["verify", newest.path]) == 0
    assert cli(["export", newest.path, str(tmp_path / "out.ckpt")]) == 0
    exported = torch.load(tmp_path / "out.ckpt", weights_only=False)
    assert exported["step"] == agreed and "tok.weight" in exported["model"] and exported["optimizer"]["state"]
    results = _run(tmp_path)
    for r in results:
        assert r["start_step"] == agreed and r["step"] == STEPS and r["restored"] == "mid-epoch", r
        assert r["resumed_from"] == newest.path
    assert results[0]["weights"] == results[1]["weights"]


def test_a_two_rank_checkpoint_resumes_at_world_size_1(tmp_path: Path) -> None:
    _run(tmp_path, "--signal-at", "5", "--signal-rank", "0", expect=143)
    newest = newest_valid(str(tmp_path / "ck"))
    assert newest is not None and newest.world_size == 2
    [result] = _run(tmp_path, devices=1)
    # one rank now takes the rest of the saved epoch's order (96 - 8k samples: 12 - k batches
    # per rank at 2, 24 - 2k at 1), then whole epochs of 24 batches
    k = newest.step
    assert result["start_step"] == k and result["step"] == k + (24 - 2 * k) + 24, result
    assert result["resumed_from"] == newest.path and result["restored"] == "resharded"


def test_three_preemptions_at_random_steps_end_bit_identical(tmp_path: Path) -> None:
    [expected, _] = _run(tmp_path / "straight")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    at = sorted(rng.sample(range(2, STEPS - 2, 3), 3))  # spaced: each rerun passes the previous snapshot
    for step in at:
        _run(tmp_path, "--signal-at", str(step), "--signal-rank", str(rng.randrange(2)), expect=143)
    final = _run(tmp_path)
    assert all(r["weights"] == expected["weights"] for r in final), f"seed {seed}, preempted at {at}"
    assert final[0]["step"] == STEPS and final[0]["start_step"] >= at[-1]


@pytest.mark.timeout(900)
def test_a_three_rank_ddp_loop_preempted_ends_bit_identical(tmp_path: Path) -> None:
    """At 3 ranks gloo's sums depend on where a gradient sits in DDP's bucket: the resumed
    loop's DDP, built by ``fabric.setup`` before the load, is given the saved run's rebuilt
    layout (resume/ddp_buckets.py, ``rebuild``); without it the weights differ in the last bits."""
    expected = _run(tmp_path / "straight", devices=3)
    _run(tmp_path, "--signal-at", "5", "--signal-rank", "2", devices=3, expect=143)
    newest = newest_valid(str(tmp_path / "ck"))
    assert newest is not None and newest.world_size == 3 and newest.step >= 5
    final = _run(tmp_path, devices=3)
    for r, e in zip(final, expected, strict=True):
        assert r["start_step"] == newest.step and r["step"] == e["step"] and r["restored"] == "mid-epoch", r
        assert r["weights"] == e["weights"], (r, e)


FORK_WORKER = textwrap.dedent(
    """
    import sys, torch, lightning as L
    from lightning_preempt import ShardedAsyncCheckpointIO

    def work(fabric):
        fabric.save(sys.argv[1], {"model": torch.nn.Linear(512, 512), "step": 100,
                                  "input_shape": torch.Size([3, 32, 32])})

    if __name__ == "__main__":
        L.Fabric(accelerator="cpu", devices=2, strategy=sys.argv[2],
                 plugins=[ShardedAsyncCheckpointIO()]).launch(work)
    """
)


@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_notebook", "ddp_spawn"])
def test_the_last_save_of_a_launched_worker_is_committed(tmp_path: Path, strategy: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(FORK_WORKER)
    path = tmp_path / "out" / "final.ckpt"
    proc = subprocess.run([sys.executable, str(script), str(path), strategy], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = newest_valid(str(path.parent))
    assert info is not None and info.path == str(path) and info.step == 100 and info.world_size == 2  # both ranks wrote their share
    from lightning_preempt import ShardedAsyncCheckpointIO

    loaded = ShardedAsyncCheckpointIO().load_checkpoint(str(path))
    assert loaded["model"]["weight"].shape == (512, 512) and loaded["input_shape"].numel() == 3072


def test_model_parallel_fsdp2_on_cpu_preempts_resumes_and_ends_bit_identical(tmp_path: Path) -> None:
    """Fabric's ModelParallelStrategy (fully_shard over 2 gloo ranks) takes no CheckpointIO
    plugin: Preemption routes its saves and loads (fabric/model_parallel.py). Fabric's
    FSDPStrategy refuses CPU ("FSDP is only available on GPU")."""
    mp = ("--strategy", "model_parallel")
    [expected, _] = _run(tmp_path / "straight", *mp)
    _run(tmp_path, *mp, "--signal-at", "9", "--signal-rank", "1", expect=143)
    newest = newest_valid(str(tmp_path / "ck"))
    assert newest is not None and newest.world_size == 2 and newest.step >= 9
    for r in _run(tmp_path, *mp):
        assert r["start_step"] == newest.step and r["restored"] == "mid-epoch"
        assert r["weights"] == expected["weights"] and r["step"] == STEPS


def _resize_phase(tmp: Path, phase: str, devices: int, *extra: str, expect: int = 0) -> list[dict[str, Any]]:
    """One ``fabric_script.py --indices`` run (its own status folder); each rank's trained lines."""
    st = tmp / phase
    st.mkdir()
    proc = launch("fabric_script.py", tmp, "--indices", "--dirpath", str(tmp / "ck"), "--status", str(st),
                  "--devices", str(devices), "--signal-rank", "0", *extra)  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == expect, out[-4000:]
    assert [read(st / f"rank{r}.exit") for r in range(devices)] == [str(expect)] * devices, out[-4000:]
    return [json.loads(line) for r in range(devices) for line in (st / f"rank{r}.trained").read_text().splitlines()]


def test_a_loop_resized_from_3_to_2_ranks_trains_every_sample_of_the_epoch_once(tmp_path: Path) -> None:
    """Issue 32: a Fabric loop preempted at 3 ranks mid-epoch and resumed at 2 goes on with
    the rest of the same epoch order split 2 ways (docs/elastic.md "Data at a resize"), as
    the Trainer does: every index of epoch 0 once over both runs, epoch 1 one whole pass."""
    before = _resize_phase(tmp_path, "at3", 3, "--signal-at", "3", expect=143)
    newest = newest_valid(str(tmp_path / "ck"))
    assert newest is not None and newest.world_size == 3 and newest.step >= 3
    after = _resize_phase(tmp_path, "at2", 2)
    epoch0 = Counter(i for line in before if line["step"] <= newest.step for i in line["indices"])
    epoch0.update(i for line in after if line["epoch"] == 0 for i in line["indices"])
    n = 96  # fabric_script.N
    twice = {i: c for i, c in epoch0.items() if c > 1}
    assert set(epoch0) == set(range(n)) and not twice, f"missing {sorted(set(range(n)) - set(epoch0))}, twice {twice}"
    epoch1 = Counter(i for line in after if line["epoch"] == 1 for i in line["indices"])
    assert epoch1 == Counter(range(n)), "the next epoch is one whole pass at 2 ranks"
    results = [json.loads(read(tmp_path / "at2" / f"rank{r}.result.json")) for r in range(2)]
    assert all(r["start_step"] == newest.step and r["restored"] == "resharded" for r in results), results
