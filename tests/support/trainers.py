"""Real ``Trainer``s for in-process tests: a quiet CPU ``Trainer`` with the plugin, a probe of
the state training (re)starts from, and one ``fit`` of :class:`models.TinyModel` with a
:class:`PreemptionCallback` (the run most end-to-end tests repeat to save, then resume)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from models import TinyModel, loader

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO


def make_trainer(
    max_steps: int,
    callbacks: list[Callback] | None = None,
    plugins: list[Any] | None = None,
    *,
    root: str | Path | None = None,
    **kw: Any,
) -> L.Trainer:
    """A CPU ``Trainer`` without logger, progress bar or model summary; ``plugins`` default to
    a fresh :class:`ShardedAsyncCheckpointIO` (``[]``: none, Lightning's own); ``root`` is
    ``default_root_dir``; ``kw`` go to ``Trainer`` (and override these defaults)."""
    options: dict[str, Any] = {
        "max_steps": max_steps,
        "accelerator": "cpu",
        "callbacks": callbacks or [],
        "plugins": plugins if plugins is not None else [ShardedAsyncCheckpointIO()],
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if root is not None:
        options["default_root_dir"] = str(root)
    return L.Trainer(**{**options, **kw})


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


@dataclasses.dataclass
class Fit:
    """What one :func:`fit` leaves: the trained model, the start probe, the callback, the plugin."""

    model: TinyModel
    probe: StartProbe
    callback: PreemptionCallback
    io: ShardedAsyncCheckpointIO


def fit(
    dirpath: str | Path,
    max_steps: int,
    *,
    every: int | None = None,
    seed: int = 0,
    width: int = 32,
    storage_options: dict[str, Any] | None = None,
    local_dirpath: str | Path | None = None,
    io_kwargs: dict[str, Any] | None = None,
    callbacks: list[Callback] | None = None,
    **callback_kwargs: Any,
) -> Fit:
    """``trainer.fit`` of a :class:`TinyModel` (seeded with ``seed``: a "new process" after the
    first) on 10 batches, with a :class:`PreemptionCallback` saving to ``dirpath`` every
    ``every`` steps (it resumes from there) and a plugin with ``storage_options`` (two tiers
    with ``local_dirpath``)."""
    L.seed_everything(seed)
    model, probe = TinyModel(width=width), StartProbe()
    callback = PreemptionCallback(
        str(dirpath), every_n_train_steps=every, storage_options=storage_options,
        local_dirpath=str(local_dirpath) if local_dirpath is not None else None, **callback_kwargs,
    )  # fmt: skip
    io = ShardedAsyncCheckpointIO(**(io_kwargs or {}))
    make_trainer(max_steps, [callback, probe, *(callbacks or [])], plugins=[io]).fit(model, loader())
    return Fit(model, probe, callback, io)
