"""Resharding through the Trainer in one process (issue 22): the ranks of a 2-rank world are
simulated by a user's ``DistributedSampler(num_replicas=2, rank=r)``, each trained to step 3
of an epoch and saved into its own directory; a 1-rank run resumes from rank 0's checkpoint
with ``DistributedSampler(num_replicas=1)``, finishes the epoch and trains the next. Checks
the loop's epoch length (Lightning counts batches per rank) and the next epoch; the real multi-process runs are in tests/multiproc and tests/e2e/test_elastic.py.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from trainers import make_trainer

from lightning_preempt import PreemptionCallback, Tuning

N, BATCH = 48, 4


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, int, list[int]]] = []  # (epoch, batch_idx, indices)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        self.seen.append((self.current_epoch, batch_idx, idx.tolist()))
        return self.net(idx.float()[:, None]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(dirpath: Path, world: int, rank: int, max_steps: int, every: int = 3, **cb: Any) -> tuple[Recorder, L.Trainer]:
    data = TensorDataset(torch.arange(N))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
    model = Recorder()
    # The periodic save at step 3 is the one resumed (a save at the end of training counts the
    # epoch as over: Lightning ends the epoch at max_steps).
    callback = PreemptionCallback(str(dirpath), every_n_train_steps=every, tuning=Tuning(save_on_train_end=False), **cb)
    trainer = make_trainer(max_steps, [callback])
    trainer.fit(model, DataLoader(data, batch_size=BATCH, sampler=sampler))
    return model, trainer


def test_a_trainer_resumed_at_another_world_size_finishes_the_epoch_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = [_fit(tmp_path / f"rank{r}", 2, r, 3)[0] for r in range(2)]  # 3 of 6 batches per rank
    before = [i for m in first for _, _, idx in m.seen for i in idx]
    with caplog.at_level(logging.INFO, logger="lightning_preempt"):
        model, trainer = _fit(tmp_path / "rank0", 1, 0, 3 + 6 + 12)
    epoch0 = [i for e, _, idx in model.seen if e == 0 for i in idx]
    assert Counter(before + epoch0) == Counter(range(N)), "every sample of epoch 0 once"
    # Lightning's batch index goes on from the saved one; the epoch ends where the share ends.
    assert [b for e, b, _ in model.seen if e == 0] == list(range(3, 9))
    epoch1 = [idx for e, _, idx in model.seen if e == 1]
    plain = DistributedSampler(TensorDataset(torch.arange(N)), num_replicas=1, rank=0, shuffle=True, seed=7)
    plain.set_epoch(1)
    assert [i for idx in epoch1 for i in idx] == list(plain), "the next epoch: the sampler's own order, in full"
    assert trainer.num_training_batches == 12
    assert "epoch 0 was split 2 ways, now 1: 24 of its 48 samples were trained" in caplog.text


def test_a_larger_world_goes_on_past_its_own_epoch_length(tmp_path: Path) -> None:
    """1 -> 2 ranks at batch 9 of 12: each rank's count (9) is past the epoch's length at 2
    ranks (6), yet the epoch is not over: 12 samples are left, 6 (2 batches) per rank."""
    import shutil

    first, _ = _fit(tmp_path / "rank0", 1, 0, 9, every=9)
    shutil.copytree(tmp_path / "rank0", tmp_path / "rank1")
    before = [i for _, _, idx in first.seen for i in idx]
    after = [_fit(tmp_path / f"rank{r}", 2, r, 9 + 2 + 6)[0] for r in range(2)]
    epoch0 = [i for m in after for e, _, idx in m.seen if e == 0 for i in idx]
    assert Counter(before + epoch0) == Counter(range(N)), "every sample of epoch 0 once"
    assert all([b for e, b, _ in m.seen if e == 0] == [9, 10] for m in after)
