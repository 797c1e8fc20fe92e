"""``Trainer(enable_checkpointing=False)`` with a PreemptionCallback (issue 12, point 9).

PreemptionCallback is an ``OnExceptionCheckpoint`` (that is how ``fit()`` resumes from it),
and Lightning rejects every checkpoint callback when ``enable_checkpointing=False``. The
combination cannot work, so the error names PreemptionCallback and the fix; the fix (leave
``enable_checkpointing`` alone) must then add no default ``ModelCheckpoint``.
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

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path: Path, callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=3,
        accelerator="cpu",
        callbacks=callbacks,
        plugins=[ShardedAsyncCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_disabled_checkpointing_error_names_the_callback_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationException) as info:
        _trainer(tmp_path, [PreemptionCallback(str(tmp_path / "ckpt"))], enable_checkpointing=False)
    text = str(info.value)
    assert "PreemptionCallback" in text and "enable_checkpointing=False" in text
    assert "HINT: drop enable_checkpointing=False" in text
    assert "found `ModelCheckpoint`" in str(info.value.__cause__), "Lightning's own error stays as the cause"


def test_the_fix_adds_no_default_model_checkpoint(tmp_path: Path) -> None:
    """What the HINT says: without the flag, PreemptionCallback's checkpoints are the only ones."""
    cb = PreemptionCallback(str(tmp_path / "ckpt"), every_n_train_steps=2)
    trainer = _trainer(tmp_path, [cb])
    assert not [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    data = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4)
    trainer.fit(Tiny(), data)
    assert trainer.global_step == 3
    written = sorted(p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*") if p.is_file())
    assert set(written) == {"ckpt"}, f"files outside PreemptionCallback's dirpath: {written}"


def test_lightning_error_unchanged_without_preemption_callback(tmp_path: Path) -> None:
    PreemptionCallback(str(tmp_path / "ckpt"))  # installs the explanation; it must only act for our callback
    with pytest.raises(MisconfigurationException, match="found `ModelCheckpoint` in callbacks list") as info:
        _trainer(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path))], enable_checkpointing=False)
    assert "PreemptionCallback" not in str(info.value)
