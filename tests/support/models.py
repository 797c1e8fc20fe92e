"""The tests' small model and data, for in-process ``trainer.fit`` runs and the training
scripts alike (train_script.py, notices_script.py, elastic_script.py).

:class:`TinyModel` optionally reports to a status directory (``rank{R}.pid`` at setup,
``rank{R}.step`` after each batch), so a test can signal a chosen rank at a known step;
:func:`fit_reporting` adds ``rank{R}.exit`` (the exit code) and, after a normal end,
``rank{R}.result.json`` (start and final step, a digest of the weights).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class TinyModel(L.LightningModule):
    def __init__(
        self, width: int = 32, step_sleep: float = 0.0, status: str = "", lr: float = 0.05, dump_start: str = ""
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
        self.batches_seen: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.hparams.step_sleep:
            time.sleep(self.hparams.step_sleep)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_model(self) -> None:
        mesh = getattr(self, "device_mesh", None)
        if mesh is None or getattr(self, "_sharded", False):
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])
        self._sharded = True

    def setup(self, stage: str) -> None:
        if self.hparams.status:
            os.makedirs(self.hparams.status, exist_ok=True)
            with open(os.path.join(self.hparams.status, f"rank{self.global_rank}.pid"), "w") as f:
                f.write(str(os.getpid()))

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step
        if self.hparams.get("dump_start"):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            full = StateDictOptions(full_state_dict=True, cpu_offload=False)
            strategy = self.trainer.strategy
            if type(strategy).__name__ == "CPUFSDPStrategy":  # FSDP1: the state is the wrapper's
                from torch.distributed.checkpoint.state_dict import get_model_state_dict

                optim = get_optimizer_state_dict(strategy.model, self.trainer.optimizers[0], options=full)
                weights = get_model_state_dict(strategy.model, options=full)
            else:
                optim = get_optimizer_state_dict(self, self.trainer.optimizers[0], options=full)
                weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in self.state_dict().items()}
            torch.save({"weights": weights, "optim": optim}, f"{self.hparams.dump_start}.rank{self.global_rank}")

    def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.hparams.status:
            path = os.path.join(self.hparams.status, f"rank{self.global_rank}.step")
            with open(path + ".tmp", "w") as f:
                f.write(str(self.trainer.global_step))
            os.replace(path + ".tmp", path)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 512, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return TensorDataset(x, y)


def weights_digest(model: torch.nn.Module) -> list[float]:
    return [float(p.detach().double().sum()) for p in model.parameters()]


def loader(batches: int = 10, batch_size: int = 16) -> DataLoader:
    """``batches`` batches of :func:`data`, in order."""
    return DataLoader(data(batch_size * batches), batch_size=batch_size, shuffle=False)


def write_status(status: str, rank: int, what: str, text: str) -> None:
    """``<status>/rank{rank}.<what>`` (nothing without a status directory)."""
    if status:
        os.makedirs(status, exist_ok=True)
        with open(os.path.join(status, f"rank{rank}.{what}"), "w") as f:
            f.write(text)


def fit_reporting(
    trainer: L.Trainer,
    model: TinyModel,
    status: str,
    *fit_args: Any,
    extra: Callable[[], dict[str, Any]] = dict,
    **fit_kwargs: Any,
) -> int:
    """``trainer.fit(model, …)``, then the status files: ``rank{R}.exit`` (also when the
    fit exits, e.g. 143 after a preemption) and ``rank{R}.result.json`` with ``extra()``."""
    try:
        trainer.fit(model, *fit_args, **fit_kwargs)
    except SystemExit as exc:
        write_status(status, trainer.global_rank, "exit", str(exc.code))
        raise
    write_status(status, trainer.global_rank, "exit", "0")
    result = {
        "start_step": getattr(model, "start_step", None),
        "step": trainer.global_step,
        # FSDP1 moved the parameters into its flat parameters (this rank's shard): digest those
        "weights": weights_digest(trainer.strategy.model if type(trainer.strategy).__name__ == "CPUFSDPStrategy" else model),
        **extra(),
    }
    write_status(status, trainer.global_rank, "result.json", json.dumps(result))
    return 0
