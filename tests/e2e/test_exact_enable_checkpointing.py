"""``Trainer(enable_checkpointing=False)`` with a PreemptionCallback (issue 12, point 9).

Users disable the default ``ModelCheckpoint`` this way. PreemptionCallback is an
``OnExceptionCheckpoint`` (that is how ``fit()`` resumes from it), which Lightning refuses
when ``enable_checkpointing=False``; ``_compat.allow_with_disabled_checkpointing`` lets it
through when it is the only kind of checkpoint callback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from trainers import make_trainer

from lightning_preempt import PreemptionCallback, list_checkpoints


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path: Path, callbacks: list[Any], max_steps: int = 3, **kwargs: Any) -> L.Trainer:
    return make_trainer(max_steps, callbacks, root=tmp_path, **kwargs)


def _fit(trainer: L.Trainer) -> None:
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4))


def _written(tmp_path: Path) -> set[str]:
    return {p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*") if p.is_file()}


def test_disabled_checkpointing_works_with_the_callback_and_resumes(tmp_path: Path) -> None:
    """enable_checkpointing=False (no default ModelCheckpoint) with PreemptionCallback: it
    saves, and the next fit resumes from its checkpoint."""
    cb = PreemptionCallback(str(tmp_path / "ckpt"), every_n_train_steps=2)
    trainer = _trainer(tmp_path, [cb], enable_checkpointing=False)
    assert trainer.checkpoint_callbacks == [cb], "no default ModelCheckpoint was added"
    _fit(trainer)
    assert trainer.global_step == 3
    assert _written(tmp_path) == {"ckpt"}, "files outside PreemptionCallback's dirpath"
    saved = sorted(c.step for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed)
    assert saved and saved[-1] == 3, saved

    again = PreemptionCallback(str(tmp_path / "ckpt"), every_n_train_steps=2)
    trainer = _trainer(tmp_path, [again], enable_checkpointing=False, max_steps=5)
    _fit(trainer)
    assert again.resumed_from is not None and again.resumed_from.endswith("step-0000000003")
    assert trainer.global_step == 5


def test_enabled_checkpointing_adds_no_default_model_checkpoint_either(tmp_path: Path) -> None:
    """With a PreemptionCallback given, Lightning adds no default ModelCheckpoint anyway."""
    cb = PreemptionCallback(str(tmp_path / "ckpt"), every_n_train_steps=2)
    trainer = _trainer(tmp_path, [cb])
    assert not [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    _fit(trainer)
    assert trainer.global_step == 3
    assert _written(tmp_path) == {"ckpt"}, "files outside PreemptionCallback's dirpath"


def test_a_model_checkpoint_with_checkpointing_disabled_is_still_refused(tmp_path: Path) -> None:
    """Lightning's refusal stays where it is accurate: a ModelCheckpoint was given."""
    callbacks = [PreemptionCallback(str(tmp_path / "ckpt")), ModelCheckpoint(dirpath=str(tmp_path))]
    with pytest.raises(MisconfigurationException, match="found `ModelCheckpoint` in callbacks list"):
        _trainer(tmp_path, callbacks, enable_checkpointing=False)


def test_lightning_error_unchanged_without_preemption_callback(tmp_path: Path) -> None:
    PreemptionCallback(str(tmp_path / "ckpt"))  # installs the wrapper; it must only act for our callback
    with pytest.raises(MisconfigurationException, match="found `ModelCheckpoint` in callbacks list"):
        _trainer(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path))], enable_checkpointing=False)
