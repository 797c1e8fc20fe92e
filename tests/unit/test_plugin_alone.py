"""Issue 56: ``plugins=[ShardedAsyncCheckpointIO()]`` without ``PreemptionCallback`` protects
nothing from a preemption (no snapshot, no exit 143, no resume), and said so nowhere. At
``fit``'s set-up the plugin now warns once with a HINT; with the callback, in the Trainer's
list or from the model's ``configure_callbacks``, it does not. Real ``fit``s on CPU."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyModel, loader
from trainers import fit, make_trainer

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, list_checkpoints


def _alone_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "without PreemptionCallback" in str(w.message)]


def _fit_recording(trainer_fit: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_fit()
    return _alone_warnings(caught)


def test_the_plugin_alone_warns_once_at_fit_setup_and_still_saves(tmp_path: Path) -> None:
    io = ShardedAsyncCheckpointIO()
    saves = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(4, [saves], plugins=[io])
    alone = _fit_recording(lambda: trainer.fit(TinyModel(), loader()))
    assert len(alone) == 1, alone
    assert "SIGTERM" in alone[0] and "\nHINT: add the callback" in alone[0]
    # a drop-in still: ModelCheckpoint's saves went through the plugin, committed
    assert sorted(c.step for c in list_checkpoints(str(tmp_path))) == [2, 4]
    # once per plugin: a second fit with the same plugin says nothing more
    trainer = make_trainer(6, [ModelCheckpoint(dirpath=str(tmp_path / "more"))], plugins=[io])
    assert _fit_recording(lambda: trainer.fit(TinyModel(), loader())) == []


def test_with_the_callback_the_plugin_says_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(tmp_path, 4, every=2)
    assert _alone_warnings(caught) == []
    assert run.callback is not None and 4 in {c.step for c in list_checkpoints(str(tmp_path))}


class _OwnCallbacks(TinyModel):
    def __init__(self, dirpath: str) -> None:
        super().__init__()
        self.dirpath = dirpath

    def configure_callbacks(self) -> list[PreemptionCallback]:
        return [PreemptionCallback(self.dirpath, every_n_train_steps=2)]


def test_a_callback_from_configure_callbacks_counts(tmp_path: Path) -> None:
    trainer = make_trainer(4, plugins=[ShardedAsyncCheckpointIO()])
    assert _fit_recording(lambda: trainer.fit(_OwnCallbacks(str(tmp_path)), loader())) == []
    assert 4 in {c.step for c in list_checkpoints(str(tmp_path))}
