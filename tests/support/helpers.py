"""Small builders shared by the tests."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


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


class StartProbe(Callback):
    """Records the step, weights and optimizer state when training (re)starts."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        self.start_weights: dict[str, torch.Tensor] = {}
        self.start_optim: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step
        self.start_weights = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.start_optim = copy.deepcopy(trainer.optimizers[0].state_dict())
