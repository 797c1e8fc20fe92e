"""Fabric's ``log_metrics`` (issue 32): a real Fabric loop with a CSV logger gets each committed
save's figures and the resumed step through ``fabric.log_dict``, and nothing with ``log_metrics=False``."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import Tuning
from lightning_preempt.fabric import Preemption


def _fit(tmp: Path, name: str, steps: int, **options: object) -> list[dict[str, str]]:
    logger = CSVLogger(str(tmp / "logs"), name=name, version=0)
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[logger])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    data = DataLoader(TensorDataset(torch.randn(2 * steps, 4)), batch_size=2)
    state: dict[str, object] = {"model": model, "optimizer": optimizer, "step": 0}
    preempt = Preemption(fabric, dirpath=str(tmp / "ck"), every_n_train_steps=2, tuning=Tuning(lease=False, **options))
    preempt.resume(state)
    for batch in preempt.iterate(data, state):
        optimizer.zero_grad()
        model(batch[0]).sum().backward()
        optimizer.step()
        state["step"] += 1  # type: ignore[operator]
    preempt.finish(state)
    logger.finalize("success")
    path = tmp / "logs" / name / "version_0" / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_fabric_loop_logs_each_committed_save_and_the_resume_through_its_loggers(tmp_path: Path) -> None:
    rows = _fit(tmp_path, "first", 6)
    saves = [r for r in rows if r.get("checkpoint/bytes")]
    assert len(saves) >= 3, rows  # saves at steps 2, 4, 6 (the final one): every commit logged once
    assert all(float(r["checkpoint/bytes"]) > 0 and float(r["checkpoint/blocking_s"]) >= 0 for r in saves), saves
    assert sorted({int(r["step"]) for r in saves}) == [2, 4, 6], saves
    assert not any(r.get("preempt/resumed_from_step") for r in rows), rows  # a fresh start resumed nothing
    # a second run of the same loop resumes at step 6 and says so in its logger
    resumed = _fit(tmp_path, "second", 6)
    marks = [r for r in resumed if r.get("preempt/resumed_from_step")]
    assert [float(r["preempt/resumed_from_step"]) for r in marks] == [6.0], resumed


def test_log_metrics_false_logs_nothing_of_ours(tmp_path: Path) -> None:
    rows = _fit(tmp_path, "off", 4, log_metrics=False)
    assert not any(k.startswith(("checkpoint/", "preempt/")) for r in rows for k in r if r[k]), rows
