"""A small real training job used by the tests (run as a subprocess, also under DDP).

Writes ``rank{R}.pid`` and ``rank{R}.step`` (the global step after each batch) into
``--status`` so a test can signal a chosen rank at a known step; ``rank{R}.exit`` with the
exit code; and after a normal end ``rank{R}.result.json`` with the start and final step
and a digest of the weights. ``--signal-at`` makes the job SIGTERM itself at a precise
moment (a real signal, delivered by the kernel), for the edge cases.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO


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


class SelfSignal(Callback):
    """SIGTERM this process at a named moment: ``step:N``, ``validation``, ``sanity``,
    ``restore``, ``periodic-save`` (while the first periodic save is in flight) or
    ``double:N`` (at step N and again while the emergency snapshot is being written);
    ``kill:N`` sends SIGKILL at step N instead (an unannounced loss)."""

    def __init__(self, spec: str, rank: int | None) -> None:
        self.phase, _, arg = spec.partition(":")
        self.arg = int(arg) if arg else 0
        self.rank = rank
        self.fired = 0

    def _fire(self, trainer: L.Trainer) -> None:
        if self.rank is None or trainer.global_rank == self.rank:
            self.fired += 1
            os.kill(os.getpid(), signal.SIGKILL if self.phase == "kill" else signal.SIGTERM)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.phase in ("step", "double", "kill") and trainer.global_step == self.arg and not self.fired:
            self._fire(trainer)

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.phase == "validation" and not trainer.sanity_checking and not self.fired:
            self._fire(trainer)

    def on_sanity_check_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.phase == "sanity" and not self.fired:
            self._fire(trainer)

    def on_load_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        if self.phase == "restore" and not self.fired:
            self._fire(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        if self.phase == "periodic-save" and not self.fired:
            self._fire(trainer)
        elif self.phase == "double" and self.fired == 1:
            self._fire(trainer)  # a second signal while the snapshot is written


def data(n: int = 512, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return TensorDataset(x, y)


def weights_digest(model: torch.nn.Module) -> list[float]:
    return [float(p.detach().double().sum()) for p in model.parameters()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--status", default="")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--val-every", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--signal-at", default=None, help="see SelfSignal")
    p.add_argument("--signal-rank", type=int, default=None)
    p.add_argument("--agree-every", type=lambda v: v if v == "auto" else int(v), default="auto")
    p.add_argument("--data-size", type=int, default=512)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--dump-start", default="", help="save full weights + optimizer state at train start")
    p.add_argument("--local-dirpath", default=None, help="two-tier mode: node-local tier")
    p.add_argument("--storage-options", default="{}", help="JSON fsspec options for --dirpath")
    p.add_argument("--cb-kwargs", default="{}", help="JSON: more PreemptionCallback options")
    args = p.parse_args(argv)
    if os.environ.get("LP_CHAOS_DIR"):
        import chaos_fs  # noqa: F401  (registers chaos://, the fault-injecting filesystem)

    L.seed_everything(0, workers=True)
    strategy: Any = args.strategy
    if args.strategy == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    model = TinyModel(width=args.width, step_sleep=args.step_sleep, status=args.status, dump_start=args.dump_start)
    cb = PreemptionCallback(
        args.dirpath,
        every_n_train_steps=args.every,
        keep_last_n=3,
        grace_period_s=args.grace,
        agree_every_n_steps=args.agree_every,
        local_dirpath=args.local_dirpath,
        storage_options=json.loads(args.storage_options),
        **json.loads(args.cb_kwargs),
    )
    callbacks: list[Callback] = [cb]
    if args.signal_at:
        callbacks.append(SelfSignal(args.signal_at, args.signal_rank))
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        callbacks=callbacks,
        plugins=[ShardedAsyncCheckpointIO(storage_options=json.loads(args.storage_options))],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0 if not args.val_every else 2,
        val_check_interval=args.val_every or None,
        limit_val_batches=4 if args.val_every else 0,
        deterministic=args.strategy != "model_parallel",
    )
    loader = DataLoader(data(args.data_size), batch_size=args.batch_size, shuffle=False)
    val = DataLoader(data(64, seed=1), batch_size=16)
    try:
        trainer.fit(model, loader, val if args.val_every else None, ckpt_path=args.ckpt_path)
    except SystemExit as exc:
        _write(args.status, trainer.global_rank, "exit", str(exc.code))
        raise
    _write(args.status, trainer.global_rank, "exit", "0")
    result = {
        "start_step": getattr(model, "start_step", None),
        "step": trainer.global_step,
        "weights": weights_digest(model),
        "resumed_from": cb.resumed_from,
    }
    _write(args.status, trainer.global_rank, "result.json", json.dumps(result))
    return 0


def _write(status: str, rank: int, what: str, text: str) -> None:
    if status:
        os.makedirs(status, exist_ok=True)
        with open(os.path.join(status, f"rank{rank}.{what}"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
