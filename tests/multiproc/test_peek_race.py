"""Ranks peek at ``dirpath`` one by one, before their process group exists: a checkpoint
committed between two ranks' peeks (the job whose lease this one waits for, finishing) must
not read as "storage not shared", while storage that really differs between ranks must."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ranks import run_ranks

pytestmark = pytest.mark.multiproc


def _worker(rank: int, world: int, root: str, shared: bool) -> None:
    import torch
    import torch.distributed as dist

    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.errors import NotACheckpointError
    from lightning_preempt.resume.resolver import ResumeResolver
    from lightning_preempt.write.commit import SaveRequest, write_checkpoint

    url = f"{root}/ck" if shared else f"{root}/ck-rank{rank}"
    group = new_gloo_group(timeout_s=60)
    resolver = ResumeResolver(url, {}, retries=1, backoff_s=0.01)
    if rank == 0:
        resolver.peek()  # nothing there yet
    dist.barrier()
    if rank == 1:  # another job commits; rank 1 peeks after it
        tensors = {"state_dict/w": torch.ones(4)}
        write_checkpoint(SaveRequest(url=f"{url}/step-0000000007", tensors=tensors, skeleton=b"s", step=7, epoch=0))
        resolver.peek()
    dist.barrier()
    try:
        outcome: object = resolver.agree_on_peeks(group)
    except NotACheckpointError as err:
        outcome = str(err).splitlines()[0]
    Path(root, f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.parametrize("shared", [True, False], ids=["committed-between-peeks", "storage-not-shared"])
def test_a_checkpoint_committed_between_peeks_is_resumed_by_every_rank(tmp_path: Path, shared: bool) -> None:
    run_ranks(_worker, 2, tmp_path, str(tmp_path), shared)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    if shared:
        assert outcomes == [True, True]  # both resume the checkpoint that appeared
    else:  # rank 1 keeps seeing a checkpoint that rank 0 never sees: the same error on both
        for outcome in outcomes:  # (each names its own dirpath)
            assert "ranks disagree on whether" in outcome and outcome.endswith("(per rank: [False, True])")
