"""FSDP1's resume loads its optimizer state into templates made from the checkpoint's own keys
and shapes (lightning/sharded_saves.py ``optimizer_templates``), not from the gathered state."""

from __future__ import annotations

from typing import Any

import torch

from lightning_preempt.format.skeleton import split_checkpoint
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.lightning.sharded_saves import optimizer_templates
from lightning_preempt.read.load import load_sharded_checkpoint
from lightning_preempt.storage.store import Store


def _checkpoint() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    state = {
        "net.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, 4, generator=gen).double()},
        "net.bias": {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, generator=gen).double()},
    }
    groups = [{"lr": 0.1, "params": ["net.weight", "net.bias"]}]
    return {"global_step": 3, "state_dict": {"net.weight": weight, "net.bias": bias},
            "optimizer_states": [{"state": state, "param_groups": groups}]}  # fmt: skip


def test_optimizer_state_loads_into_templates_made_from_the_checkpoint(tmp_url: str) -> None:
    saved = _checkpoint()
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(saved, tmp_url)
    io.wait()
    io.teardown()
    model = {"state_dict": {k: torch.zeros_like(v) for k, v in saved["state_dict"].items()}}
    flat, _ = split_checkpoint(model)
    loaded = load_sharded_checkpoint(Store(tmp_url), flat, rank=0, template_for=optimizer_templates(flat, "state_dict", ["optimizer_states"]))
    for key, tensor in saved["state_dict"].items():
        assert torch.equal(model["state_dict"][key], tensor), key  # the model's templates, in place
    assert loaded["optimizer_states"][0]["param_groups"] == saved["optimizer_states"][0]["param_groups"]
    for fqn, entry in saved["optimizer_states"][0]["state"].items():
        got = loaded["optimizer_states"][0]["state"][fqn]
        for name, tensor in entry.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (fqn, name)


def test_a_parameter_shaped_state_takes_the_parameters_layout_and_the_saved_dtype() -> None:
    param = torch.zeros(4, 6).t()  # the parameter's own strides, kept by empty_like
    make = optimizer_templates({"state_dict/net.weight": param}, "state_dict", ["optimizer_states"])
    made = make("optimizer_states/0/state/net.weight/exp_avg", torch.Size([6, 4]), torch.float64)
    assert made.shape == (6, 4) and made.dtype == torch.float64 and made.stride() == param.stride()
    step = make("optimizer_states/0/state/net.weight/step", torch.Size([]), torch.float32)
    assert step.shape == () and step.dtype == torch.float32
    other = make("optimizer_states/0/state/net.weight/exp_avg", torch.Size([3]), torch.float32)
    assert other.shape == (3,)  # not the parameter's shape: whole on every rank
    assert make("state_dict/net.other", torch.Size([2]), torch.float32) is None  # the model's: never made up


def test_fabrics_layout_one_optimizer_under_its_own_key() -> None:
    param = torch.zeros(6, 4)
    make = optimizer_templates({"model/net.weight": param}, "model", ["optim"])
    made = make("optim/state/net.weight/exp_avg", torch.Size([6, 4]), torch.float32)
    assert made.shape == (6, 4) and made.dtype == torch.float32
    assert make("other/state/net.weight/exp_avg", torch.Size([6, 4]), torch.float32) is None  # not asked for
