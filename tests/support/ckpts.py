"""Checkpoints for the tests: a Lightning-shaped checkpoint dict, deep bitwise equality,
what a directory holds committed, and a flipped byte (damage only a CRC32C check sees)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_preempt import ShardedAsyncCheckpointIO, list_checkpoints


def lightning_like_checkpoint(step: int = 5, width: int = 4) -> dict[str, Any]:
    """A checkpoint dict shaped like Lightning's, with a trained Adam state."""
    torch.manual_seed(step)
    model = torch.nn.Linear(width, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}, "batches": [1, 2]}},
        "callbacks": {"Cb": {"best": torch.tensor(0.5), "empty": {}}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [{"last_epoch": step, "_last_lr": [0.1]}],
        "hyper_parameters": {"lr": 0.1, "layers": (1, 2)},
        "rng": torch.get_rng_state(),
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep equality with bitwise tensor comparison and matching key types."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a.keys()) == list(b.keys()), f"{path}: {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def committed(url: str | Path, storage_options: dict[str, Any] | None = None) -> list[int]:
    """The steps of the committed checkpoints under ``url``, newest first."""
    return [c.step for c in list_checkpoints(str(url), storage_options) if c.committed]


def committed_names(url: str | Path) -> list[tuple[str, int]]:
    """``(name, step)`` of the committed checkpoints under ``url``, newest first."""
    return [(c.name, c.step) for c in list_checkpoints(str(url)) if c.committed]


def flip_byte(path: str | Path, mask: int = 0xFF) -> None:
    """Flip bits of the middle byte of a file: same size, so only a checksum notices."""
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= mask
    Path(path).write_bytes(bytes(data))


def assert_loads_both_ways(url: str, ckpt: dict[str, Any]) -> None:
    """The checkpoint at ``url`` holds ``ckpt``'s state dict and step, read by our loader
    (CRC32C verified) and by DCP's own ``dcp.load`` alike."""
    import torch.distributed.checkpoint as dcp

    from lightning_preempt.read.load import load_full_checkpoint
    from lightning_preempt.storage.store import Store

    loaded = load_full_checkpoint(Store(url))
    targets = {f"state_dict/{k}": torch.empty_like(v) for k, v in ckpt["state_dict"].items()}
    dcp.load(targets, checkpoint_id=url, no_dist=True)
    for key, tensor in ckpt["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], tensor), key
        assert torch.equal(targets[f"state_dict/{key}"], tensor), key
    assert loaded["global_step"] == ckpt["global_step"]


def save_and_wait(path: str | Path, ckpt: dict[str, Any]) -> str:
    """``ckpt`` saved at ``path`` through the plugin, committed; returns the path."""
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(ckpt, str(path))
    io.wait()
    return str(path)
