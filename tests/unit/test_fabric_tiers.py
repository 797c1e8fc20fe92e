"""Two tiers under Fabric (issue 32): a real single-process Fabric loop with ``local_dirpath``
commits to the local tier, drains to ``dirpath`` (in the ledger too), and a rerun on a "new
node" (empty local tier) resumes from ``dirpath`` with the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import Tuning, newest_valid
from lightning_preempt.catalog.ledger_reader import read_ledger
from lightning_preempt.fabric import Preemption


def _loop(dirpath: Path, local: Path, steps: int) -> tuple[Preemption, dict[str, Any], int]:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = DataLoader(TensorDataset(torch.randn(2 * steps, 4)), batch_size=2)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    preempt = Preemption(fabric, dirpath=str(dirpath), every_n_train_steps=2, local_dirpath=str(local), tuning=Tuning(lease=False))
    preempt.resume(state)
    start = state["step"]
    for batch in preempt.iterate(data, state):
        optimizer.zero_grad()
        model(batch[0]).sum().backward()
        optimizer.step()
        state["step"] += 1
    preempt.finish(state)
    return preempt, state, start


def test_a_fabric_loop_with_two_tiers_drains_and_resumes_from_dirpath_on_a_new_node(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    _, state, start = _loop(remote, tmp_path / "node-a", 4)
    assert start == 0 and state["step"] == 4
    on_local = newest_valid(str(tmp_path / "node-a"))
    assert on_local is not None and on_local.step == 4
    on_remote = newest_valid(str(remote))  # finish waited for the last upload (Fabric never tears the plugin down)
    assert on_remote is not None and on_remote.step == 4
    (run,) = read_ledger(str(remote)).runs.values()
    assert [r["step"] for r in run.records if r["kind"] == "drain" and r["drained_s"] is not None][-1] == 4
    weights = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}
    second, again, start = _loop(remote, tmp_path / "node-b", 4)  # empty local tier: resumes from dirpath
    assert start == 4 and second.resumed_from is not None and second.resumed_from.startswith(str(remote)), second.resumed_from
    for k, v in again["model"].state_dict().items():
        assert torch.equal(v, weights[k]), k  # 4 steps of 4: nothing more trained, the weights restored
