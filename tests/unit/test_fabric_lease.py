"""The lease under Fabric (issue 32): while one Fabric loop's ``Preemption`` holds ``dirpath``,
a second one on the same ``dirpath`` is refused (LeaseHeldError) before it loads or saves
anything; after the first one's ``finish`` the second takes it and resumes its checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_preempt import Tuning
from lightning_preempt.fabric import Preemption
from lightning_preempt.save.lease import LeaseHeldError


def _setup(dirpath: Path) -> tuple[Preemption, dict[str, Any]]:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    return Preemption(fabric, dirpath=str(dirpath), every_n_train_steps=2, tuning=Tuning(lease_timeout_s=1.0)), state


def test_a_second_fabric_loop_on_a_held_dirpath_is_refused_until_the_first_finishes(tmp_path: Path) -> None:
    first, state = _setup(tmp_path / "ck")
    first.resume(state)
    state["step"] = 3
    second, other = _setup(tmp_path / "ck")
    with pytest.raises(LeaseHeldError):
        second.resume(other)
    assert other["step"] == 0
    first.finish(state)  # the final save at step 3, then the lease released
    third, again = _setup(tmp_path / "ck")
    third.resume(again)
    assert again["step"] == 3 and third.resumed_from is not None
    third.finish(again)
