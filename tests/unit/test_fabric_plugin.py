"""The plugin under Fabric in one process: ``fabric.save`` is an asynchronous sharded save
whose modules' and optimizers' tensors go to the DCP shards without naming ``sharded_keys``
(issue 21, finding c); ``fabric.load`` keeps Fabric's contract (state restored in place,
``strict``, the returned remainder, exact container types)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.format.pickles.unpickle import load_state_bytes


def _fabric() -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[ShardedAsyncCheckpointIO()])
    fabric.launch()
    return fabric


def _trained(fabric: L.Fabric, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    fabric.backward(model(torch.randn(4, 6)).sum())
    opt.step()
    return model, opt


def test_fabric_save_shards_modules_and_optimizers_and_load_keeps_the_contract(tmp_path: Path) -> None:
    fabric = _fabric()
    model, opt = _trained(fabric, 0)
    path = tmp_path / "ck"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 100, "input_shape": torch.Size([3, 32, 32]),
                       "note": "hello"})  # fmt: skip
    io = fabric.strategy.checkpoint_io
    assert isinstance(io, ShardedAsyncCheckpointIO)
    manifest = io.wait()
    # the modules' and optimizers' tensors are DCP shards, the per-rank skeleton holds placeholders
    skeleton = load_state_bytes((path / "state-rank00000.pt").read_bytes(), path=str(path))
    assert type(skeleton["model"]["0.weight"]).__name__ == "TensorRef"
    assert type(skeleton["optimizer"]["state"][0]["exp_avg"]).__name__ == "TensorRef"
    assert manifest is not None and manifest.step == 100  # the loop's "step" is the checkpoint's step

    other, other_opt = _trained(fabric, 1)
    state = {"model": other, "optimizer": other_opt, "step": 0}
    with pytest.raises(KeyError, match="absent"):  # strict: the state asks for a key the checkpoint lacks
        fabric.load(path, {**state, "absent": 1}, strict=True)
    remainder = fabric.load(path, {**state, "absent": 1}, strict=False)
    state = {"model": other, "optimizer": other_opt, "step": 0}
    remainder = fabric.load(path, state)
    assert state["step"] == 100 and set(remainder) == {"input_shape", "note"}
    assert type(remainder["input_shape"]) is torch.Size and remainder["input_shape"].numel() == 3072
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], other_opt.state_dict()["state"][0]["exp_avg"])
    full = fabric.load(path)
    assert set(full) == {"model", "optimizer", "step", "input_shape", "note"}
