"""Checkpoints written before the 0.2.0 release (tests/data/v0_2, see its README) and in
format 2 (tests/data/format2: a ``TensorRef(key)`` per tensor, before the skeleton listed its
keys) still verify, load and resume: the restructure moved every module, but a checkpoint
names one of our classes in its pickles (``lightning_preempt.format.TensorRef``) and its
layout is read by code that moved."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import lightning as L
import torch
from models import TinyModel, data
from torch.utils.data import DataLoader

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning, verify_checkpoint
from lightning_preempt.cli import main as cli_main
from lightning_preempt.storage.store import Store

OLD = Path(__file__).resolve().parents[1] / "data" / "v0_2"
STEP3 = OLD / "run" / "step-0000000003"
FORMAT2 = Path(__file__).resolve().parents[1] / "data" / "format2"


class Buffered(TinyModel):
    """tests/data/format2's model: 44 tensors in its ``state_dict``."""

    def __init__(self, width: int = 4) -> None:
        super().__init__(width=width)
        for i in range(40):
            self.register_buffer(f"b{i}", torch.full((3,), float(i)))


def test_old_checkpoints_verify_with_the_library_and_the_light_cli(capsys) -> None:  # type: ignore[no-untyped-def]
    for path in (STEP3, OLD / "replaced.ckpt"):
        manifest = verify_checkpoint(Store(str(path)))
        assert manifest.files and all(entry.size > 0 for entry in manifest.files.values())
        assert cli_main(["verify", str(path)]) == 0  # sizes, CRC32C, loads without trust (no torch)
        assert "loads without trust_checkpoints" in capsys.readouterr().out


def test_an_old_trainer_checkpoint_loads_with_its_weights_and_exact_resume_state() -> None:
    checkpoint = ShardedAsyncCheckpointIO().load_checkpoint(str(STEP3))
    assert checkpoint["global_step"] == 3
    weights = torch.load(OLD / "run_weights.pt", weights_only=True)
    assert checkpoint["state_dict"].keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(checkpoint["state_dict"][key], value), key
    adam = checkpoint["optimizer_states"][0]["state"]
    assert sorted(adam) == [0, 1, 2, 3] and all(int(s["step"]) == 3 for s in adam.values())
    assert checkpoint["lightning_preempt"]["global_step"] == 3  # the exact-resume state


def test_an_old_replaced_checkpoint_loads_its_newest_generation() -> None:
    checkpoint = ShardedAsyncCheckpointIO().load_checkpoint(str(OLD / "replaced.ckpt"))
    assert torch.equal(checkpoint["state_dict"]["w"], torch.arange(6, dtype=torch.float32) * 2)
    assert checkpoint["hyper_parameters"] == {"lr": 0.1, "shape": (2, 3)}
    assert checkpoint["global_step"] == 5


def _resuming_trainer(dirpath: Path, probe: L.Callback) -> L.Trainer:
    """A Trainer to step 5 that resumes from ``dirpath`` (saving step 5 there)."""
    return L.Trainer(
        max_steps=5, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[PreemptionCallback(dirpath=str(dirpath), every_n_train_steps=5, tuning=Tuning(lease=False)), probe],
        plugins=[ShardedAsyncCheckpointIO()],
    )  # fmt: skip


def test_a_trainer_resumes_from_an_old_dirpath_and_goes_on(tmp_path: Path) -> None:
    dirpath = tmp_path / "run"
    shutil.copytree(OLD / "run", dirpath)
    started: list[tuple[int, dict[str, torch.Tensor]]] = []

    class Probe(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            started.append((trainer.global_step, {k: v.clone() for k, v in pl_module.state_dict().items()}))

    trainer = _resuming_trainer(dirpath, Probe())
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    lightning_log.addHandler(handler)
    try:
        trainer.fit(TinyModel(width=4), DataLoader(data(n=32), batch_size=8, shuffle=True))
    finally:
        lightning_log.removeHandler(handler)
    # Lightning's own lines name the checkpoint, not the resume pointer (docs/design.md)
    restoring = [line for line in lines if "estor" in line]
    assert restoring == [f"Restoring states from the checkpoint path at {dirpath / 'step-0000000003'}",
                         f"Restored all states from the checkpoint at {dirpath / 'step-0000000003'}"]
    step, weights = started[0]
    assert step == 3
    expected = torch.load(OLD / "run_weights.pt", weights_only=True)
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    assert trainer.global_step == 5 and (dirpath / "step-0000000005" / "manifest.json").is_file()


def test_a_format_2_checkpoint_verifies_loads_and_resumes_into_format_3(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Issue 33's format change: a format-2 state file (a ``TensorRef`` per tensor) loads with
    its exact values, and a resume from it goes on and writes format 3."""
    import json

    step3 = FORMAT2 / "run" / "step-0000000003"
    assert json.loads((step3 / "manifest.json").read_text())["version"] == 2
    assert verify_checkpoint(Store(str(step3))).version == 2
    assert cli_main(["verify", str(step3)]) == 0
    assert "loads without trust_checkpoints" in capsys.readouterr().out
    checkpoint = ShardedAsyncCheckpointIO().load_checkpoint(str(step3))
    weights = torch.load(FORMAT2 / "run_weights.pt", weights_only=True)
    assert checkpoint["global_step"] == 3 and list(checkpoint["state_dict"]) == list(weights)
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in weights.items())
    assert "lightning_preempt.refs" not in checkpoint

    dirpath = tmp_path / "run"
    shutil.copytree(FORMAT2 / "run", dirpath)
    started: list[dict[str, torch.Tensor]] = []

    class Probe(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            started.append({k: v.clone() for k, v in pl_module.state_dict().items()})

    trainer = _resuming_trainer(dirpath, Probe())
    trainer.fit(Buffered(), DataLoader(data(n=32), batch_size=8, shuffle=True))
    assert trainer.global_step == 5
    assert all(torch.equal(started[0][k], v) for k, v in weights.items())  # resumed from the format-2 weights
    newer = dirpath / "step-0000000005"
    assert json.loads((newer / "manifest.json").read_text())["version"] == 3
    from lightning_preempt.format import TensorDict
    from lightning_preempt.format.pickles.unpickle import load_state_bytes

    skeleton = load_state_bytes((newer / "state-rank00000.pt").read_bytes(), path=str(newer))
    assert type(skeleton["state_dict"]) is TensorDict and skeleton["state_dict"].count == 44
    again = ShardedAsyncCheckpointIO().load_checkpoint(str(newer))
    assert again["global_step"] == 5 and torch.equal(again["state_dict"]["b39"], torch.full((3,), 39.0))
