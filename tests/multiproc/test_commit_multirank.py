"""The commit protocol across 2 real ranks (gloo): one rank failing mid-write must leave
no committed checkpoint, and every rank must raise the same error instead of hanging."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from ranks import run_ranks

pytestmark = pytest.mark.multiproc


def _worker(rank: int, world: int, out_dir: str, failing_rank: int) -> None:
    import torch
    from faulty_fs import FaultyFileSystem

    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.errors import CheckpointWriteError
    from lightning_preempt.storage.store import Store
    from lightning_preempt.write.commit import SaveRequest, write_checkpoint

    group = new_gloo_group(timeout_s=60)
    # Each process has its own in-memory "faulty://" store; only the failing rank's breaks.
    FaultyFileSystem.reset(fail_after_bytes=1000 if rank == failing_rank else None)
    tensors = {f"state_dict/w{i}": torch.full((4096,), float(i)) for i in range(8)}
    request = SaveRequest(url="faulty://run/step-1", tensors=tensors, skeleton=b"skeleton", step=1, epoch=0)
    outcome: dict[str, object] = {"rank": rank}
    started = time.monotonic()
    try:
        write_checkpoint(request, group=group)
        outcome["error"] = None
    except CheckpointWriteError as err:
        outcome["error"] = str(err)
    outcome["seconds"] = time.monotonic() - started
    outcome["manifest_here"] = Store("faulty://run/step-1").stat("manifest.json") is not None
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_one_rank_failing_commits_nothing_and_every_rank_raises(tmp_path: Path, failing_rank: int) -> None:
    run_ranks(_worker, 2, tmp_path, str(tmp_path), failing_rank, on_hang=lambda: "instead of failing together")
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for o in outcomes:
        assert o["error"], o
        assert "nothing was committed" in o["error"] and "HINT:" in o["error"]
        assert (
            f"rank {failing_rank}: lightning_preempt.errors.CheckpointWriteError: writing the shards failed: OSError: [Errno 28] No space left on device (injected)"
            in o["error"]
        )
        assert o["manifest_here"] is False
    assert os.path.exists(tmp_path / "rank0.json")
