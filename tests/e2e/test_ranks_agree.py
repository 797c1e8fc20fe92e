"""Ranks that built different options (issue 55, item 9): real 2-rank fits over gloo.

A ``dirpath`` computed per process (a timestamp in a run name: every rank runs the script
again) used to make rank 0 commit manifests listing shards written into another rank's
directory: every committed checkpoint was unverifiable. Now every rank refuses at set-up,
before step 1, naming each value and its ranks, with a HINT.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import launch

from lightning_preempt import list_checkpoints, verify_checkpoint
from lightning_preempt.storage.store import Store

pytestmark = pytest.mark.multiproc


def test_ranks_with_different_dirpaths_refuse_before_step_1_and_nothing_unverifiable_is_committed(
    tmp_path: Path,
) -> None:
    base = tmp_path / "ck"
    proc = launch("train_script.py", tmp_path, "--dirpath", str(base), "--dirpath-per-rank", "--devices", "2",
                  "--strategy", "ddp", "--every", "2", "--max-steps", "6", "--status", str(tmp_path / "st"))  # fmt: skip
    out, _ = proc.communicate(timeout=240)
    committed = [c for rank in (0, 1) for c in list_checkpoints(f"{base}-rank{rank}") if c.committed]
    for ckpt in committed:  # before the fix: rank 0's manifests listed rank 1's shard, written elsewhere
        verify_checkpoint(Store(ckpt.path))
    assert proc.returncode not in (0, None), out[-4000:]
    assert not committed
    assert out.count("RanksDisagreeError") >= 2, out[-4000:]  # both ranks raised it
    assert f'dirpath: "{base}-rank0" on rank 0; "{base}-rank1" on rank 1' in out, out[-4000:]
    assert "HINT: every rank runs your script" in out
    assert not (tmp_path / "st" / "rank0.step").exists()  # not a step trained
