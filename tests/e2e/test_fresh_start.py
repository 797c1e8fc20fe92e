"""Never a silent fresh start: a dirpath where an earlier run made progress, with nothing in it
to resume from, stops the fit before step 1 with a HINT (engine/fresh_start.py); so does a
strategy whose saves would bypass the plugin (lightning/strategies.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import committed
from lightning.pytorch.strategies import SingleDeviceStrategy
from models import TinyModel, loader
from trainers import StartProbe, fit, make_trainer

from lightning_preempt import PreemptionCallback, ProgressWouldBeLostError
from lightning_preempt.format.names import LEDGER_DIR, checkpoint_name


def _partial_save(root: Path, step: int) -> None:
    """What a save that never committed leaves (a killed writer, a strategy that bypassed the plugin)."""
    (root / checkpoint_name(step)).mkdir(parents=True)
    (root / checkpoint_name(step) / "__0_0.distcp").write_bytes(b"\x00" * 4096)


def test_only_partial_saves_of_an_earlier_run_stop_the_start(tmp_path: Path) -> None:
    _partial_save(tmp_path, 25)
    with pytest.raises(ProgressWouldBeLostError) as err:
        fit(tmp_path, max_steps=5, every=5)
    text = str(err.value)
    assert checkpoint_name(25) in text and "resume=False" in text and "HINT" in text
    assert committed(tmp_path) == []  # not a step trained, nothing saved over it
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [checkpoint_name(25)]


def test_a_ledger_of_committed_saves_with_no_checkpoint_left_stops_the_start(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=10, every=5)
    assert committed(tmp_path) == [10, 5] and (tmp_path / LEDGER_DIR).is_dir()
    for step in (5, 10):
        shutil.rmtree(tmp_path / checkpoint_name(step))
    with pytest.raises(ProgressWouldBeLostError, match=r"records \d+ committed save\(s\), up to step 10"):
        fit(tmp_path, max_steps=15, every=5)
    assert committed(tmp_path) == []


def test_resume_false_starts_over_on_purpose(tmp_path: Path) -> None:
    _partial_save(tmp_path, 25)
    run = fit(tmp_path, max_steps=5, every=5, resume=False)
    assert run.probe.start_step == 0 and committed(tmp_path) == [5]


def test_a_new_dirpath_starts_at_step_0(tmp_path: Path) -> None:
    run = fit(tmp_path / "new", max_steps=5, every=5)
    assert run.probe.start_step == 0 and committed(tmp_path / "new") == [5]


class _SavesByItself(SingleDeviceStrategy):
    """A user's strategy with its own save (as XLA's): it would bypass the plugin."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        torch.save(checkpoint, filepath)


def test_a_strategy_that_saves_by_itself_is_refused_before_step_1(tmp_path: Path) -> None:
    probe = StartProbe()
    trainer = make_trainer(5, [PreemptionCallback(str(tmp_path), every_n_train_steps=2), probe],
                           strategy=_SavesByItself(device=torch.device("cpu")))  # fmt: skip
    with pytest.raises(TypeError, match=r"does not support _SavesByItself(.|\n)*HINT: use strategy='ddp'"):
        trainer.fit(TinyModel(), loader())
    assert probe.start_step is None and committed(tmp_path) == []
