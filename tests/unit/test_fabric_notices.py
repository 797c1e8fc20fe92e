"""Cloud notices under Fabric (issue 32): a notice source (a real ``PreemptionSource``, as the
metadata pollers are) that announces a reclaim mid-loop with ``on_notice="exit"``: the loop
snapshots the agreed step, raises ``Preempted`` (143), and a rerun resumes at that step."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import Preempted, Tuning, newest_valid
from lightning_preempt.fabric import Preemption
from lightning_preempt.preemption.sources import Notice


class Announce:
    """Announces a reclaim once :attr:`fire` is set (by the loop, at a chosen step)."""

    name = "test-cloud"

    def __init__(self) -> None:
        self.fire = False

    def start(self) -> None:
        pass

    def poll(self) -> Notice | None:
        return Notice("test-cloud", "reclaim announced", time.monotonic(), time.monotonic() + 30) if self.fire else None

    def stop(self) -> None:
        pass


def _loop(dirpath: Path, steps: int, source: Announce | None, fire_at: int) -> tuple[Preemption, dict[str, Any], int]:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = DataLoader(TensorDataset(torch.randn(2 * steps, 4)), batch_size=2)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    preempt = Preemption(fabric, dirpath=str(dirpath), every_n_train_steps=100, notices=[source] if source else [],
                         tuning=Tuning(requeue=False, on_notice="exit", lease=False))  # fmt: skip
    preempt.resume(state)
    start = state["step"]
    for batch in preempt.iterate(data, state):
        optimizer.zero_grad()
        model(batch[0]).sum().backward()
        optimizer.step()
        state["step"] += 1
        if source is not None and state["step"] == fire_at:
            source.fire = True
    preempt.finish(state)
    return preempt, state, start


def test_a_notice_with_on_notice_exit_snapshots_raises_preempted_and_the_rerun_resumes_there(tmp_path: Path) -> None:
    with pytest.raises(Preempted) as info:
        _loop(tmp_path / "ck", 12, Announce(), fire_at=3)
    assert info.value.code == 143
    newest = newest_valid(str(tmp_path / "ck"))
    assert newest is not None and 3 <= newest.step < 12, newest  # the snapshot at the agreed step, not the end
    _, state, start = _loop(tmp_path / "ck", 12, None, fire_at=-1)
    assert start == newest.step and state["step"] == 12
