"""Sample-exact resharding with real gloo ranks (no torchrun): the world size goes 2 -> 1 -> 2
between restarts inside one epoch; every sample of the epoch is trained once, for a
DataLoader and a StatefulDataLoader over a DistributedSampler (Lightning's
DistributedSamplerWrapper: tests/unit/test_reshard.py, in one process) (``reshard_loop.rank_worker``: a hand-written loop over
the neutral pieces; each phase's ranks are fresh processes resuming from the files of the last).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from ranks import run_ranks
from reshard_loop import PLAIN_KINDS, rank_worker

pytestmark = pytest.mark.multiproc

# (epoch, batches to train; None: to the epoch's end, then the next epoch in full) per phase
PLAN = [(0, 2), (0, 3), (0, None)]
WORLDS = [2, 1, 2]
N = 48


def test_world_size_2_1_2_trains_every_sample_of_the_epoch_once(tmp_path: Path) -> None:
    for phase, world in enumerate(WORLDS):
        run_ranks(rank_worker, world, tmp_path, str(tmp_path), phase, json.dumps(PLAN), timeout_s=120)
    for kind in PLAIN_KINDS:
        epoch0: Counter[int] = Counter()
        for phase, world in enumerate(WORLDS):
            for rank in range(world):
                epoch0.update(json.loads((tmp_path / f"{phase}-rank{rank}.json").read_text())[kind])
        missing = set(range(N)) - set(epoch0)
        twice = {i: c for i, c in epoch0.items() if c > 1}
        assert not missing and not twice, f"{kind}: missing {sorted(missing)}, twice {twice}"
        # 2 batches x 4 x 2 ranks, then 3 x 4 x 1: 28 trained before the last phase.
        assert sum(epoch0.values()) == N
        last = [json.loads((tmp_path / f"2-rank{r}.json").read_text()) for r in range(2)]
        epoch1 = Counter(i for out in last for i in out[f"{kind}-next"])
        assert epoch1 == Counter(range(N)), f"{kind}: the next epoch is one pass again"
