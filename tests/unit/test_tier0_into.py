"""A sealed tier-0 copy read straight into the caller's tensors (read/tensors.py ``into``):
the model's own parameters get the saved bytes with no tensor of their own; anything that
must be CRC-checked first (unsealed, damaged after the seal, on a disk) leaves them untouched."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import save_and_wait

from lightning_preempt.engine.memory_tier import seal_copy
from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.read.seal import on_tmpfs
from lightning_preempt.storage.store import Store

pytestmark = pytest.mark.skipif(not on_tmpfs("/dev/shm"), reason="/dev/shm is not a tmpfs here")


def _checkpoint() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {
        "global_step": 3,
        "state_dict": {
            "net.weight": torch.randn(512, 300, generator=gen),  # ~600 KiB: a batched small record
            "big.weight": torch.randn(1024, 520, generator=gen),  # > 1 MiB: read straight in
            "net.bias": torch.randn(300, generator=gen).half(),
            "steps": torch.tensor(7),
        },
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(512, 300, generator=gen)}}, "param_groups": []}],
    }


def _params(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Destinations shaped like the saved model, holding other values (a fresh model's)."""
    out = {f"state_dict/{k}": torch.nn.Parameter(torch.full_like(v, 5)) for k, v in ckpt["state_dict"].items()
           if v.is_floating_point()}  # fmt: skip
    out["state_dict/steps"] = torch.tensor(0)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _untouched(into: dict[str, torch.Tensor]) -> None:
    for key, t in into.items():
        assert _bytes(t) == _bytes(torch.full_like(t, 5 if t.is_floating_point() else 0)), key


def test_a_sealed_copy_is_read_into_the_given_tensors(shm: Path) -> None:
    ckpt = _checkpoint()
    path = save_and_wait(shm / "step-3", ckpt)
    assert seal_copy(path)
    into = _params(ckpt)
    ptrs = {k: t.data_ptr() for k, t in into.items()}
    got = load_full_checkpoint(Store(path), into=into)
    for key, saved in ckpt["state_dict"].items():
        dest = into[f"state_dict/{key}"]
        assert got["state_dict"][key] is dest  # the very tensor: Lightning's copy into the model is a no-op
        assert dest.data_ptr() == ptrs[f"state_dict/{key}"] and dest.dtype == saved.dtype
        assert _bytes(dest) == _bytes(saved), key
    assert all(p.requires_grad for k, p in into.items() if k != "state_dict/steps")
    exp_avg = got["optimizer_states"][0]["state"][0]["exp_avg"]  # not given: a tensor of its own
    assert _bytes(exp_avg) == _bytes(ckpt["optimizer_states"][0]["state"][0]["exp_avg"])
    assert all(exp_avg.data_ptr() != t.data_ptr() for t in into.values())


def test_a_destination_that_does_not_fit_gets_a_tensor_of_its_own(shm: Path) -> None:
    ckpt = _checkpoint()
    path = save_and_wait(shm / "step-3", ckpt)
    assert seal_copy(path)
    into = {
        "state_dict/net.weight": torch.zeros(300, 512),  # another shape
        "state_dict/big.weight": torch.zeros(1024, 520, dtype=torch.float64),  # another dtype
        "state_dict/net.bias": torch.zeros(600).half()[::2],  # not contiguous
    }
    before = {k: _bytes(t) for k, t in into.items()}
    got = load_full_checkpoint(Store(path), into=into)
    for key in ("net.weight", "big.weight", "net.bias"):
        assert got["state_dict"][key] is not into[f"state_dict/{key}"]
        assert _bytes(got["state_dict"][key]) == _bytes(ckpt["state_dict"][key])
        assert _bytes(into[f"state_dict/{key}"]) == before[f"state_dict/{key}"]


def test_an_unsealed_copy_is_verified_and_leaves_them_untouched(shm: Path) -> None:
    ckpt = _checkpoint()
    path = save_and_wait(shm / "step-3", ckpt)  # committed, not sealed: the CRC32C pass runs
    into = _params(ckpt)
    got = load_full_checkpoint(Store(path), into=into)
    _untouched(into)
    for key, saved in ckpt["state_dict"].items():
        assert got["state_dict"][key] is not into[f"state_dict/{key}"]
        assert _bytes(got["state_dict"][key]) == _bytes(saved)


def test_a_copy_damaged_after_the_seal_is_refused_before_any_is_written(shm: Path) -> None:
    ckpt = _checkpoint()
    path = save_and_wait(shm / "step-3", ckpt)
    assert seal_copy(path)
    victim = max((os.path.join(path, n) for n in os.listdir(path)), key=os.path.getsize)
    with open(victim, "r+b") as f:  # same size, same inode: the ctime breaks the seal
        f.seek(os.path.getsize(victim) // 2)
        f.write(b"\x00\xff" * 64)
    into = _params(ckpt)
    with pytest.raises(CorruptCheckpointError):
        load_full_checkpoint(Store(path), into=into)
    _untouched(into)


def test_not_on_a_disk_nor_with_a_map_location(shm: Path, tmp_path: Path) -> None:
    ckpt = _checkpoint()
    disk = save_and_wait(tmp_path / "step-3", ckpt)
    assert not seal_copy(disk)  # a disk directory is never sealed
    into = _params(ckpt)
    load_full_checkpoint(Store(disk), into=into)
    mem = save_and_wait(shm / "step-3", ckpt)
    assert seal_copy(mem)
    got = load_full_checkpoint(Store(mem), into=into, map_location="cpu")
    _untouched(into)
    assert _bytes(got["state_dict"]["big.weight"]) == _bytes(ckpt["state_dict"]["big.weight"])


def test_only_the_alias_given_them_writes_into_them(shm: Path) -> None:
    ckpt = _checkpoint()
    path = save_and_wait(shm / "step-3", ckpt)
    assert seal_copy(path)
    into = _params(ckpt)
    io = ShardedAsyncCheckpointIO()
    io.alias("pointer", path, into=lambda: into)
    plain = io.load_checkpoint(path)  # the same checkpoint by its own path: a dict of its own
    _untouched(into)
    assert plain["state_dict"]["big.weight"] is not into["state_dict/big.weight"]
    got = io.load_checkpoint("pointer")
    assert got["state_dict"]["big.weight"] is into["state_dict/big.weight"]
    assert _bytes(into["state_dict/big.weight"]) == _bytes(ckpt["state_dict"]["big.weight"])
    assert io.loaded_from == path


def test_the_callback_names_the_parameters_by_the_checkpoints_keys() -> None:
    import lightning.pytorch as pl

    from lightning_preempt.format.skeleton import split_checkpoint
    from lightning_preempt.lightning.callback import _model_tensors

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))

    model = Model()
    flat, _ = split_checkpoint({"state_dict": model.state_dict(), "global_step": 1})
    given = _model_tensors(model)
    assert set(given) == set(flat) and len(given) == 7  # weight, bias, BatchNorm's 5
    assert given["state_dict/net.0.weight"] is model.net[0].weight  # the parameter itself
    assert given["state_dict/net.1.running_mean"] is model.net[1].running_mean
