"""A training job whose results depend on every RNG draw and on the data order.

Used by ``tests/test_exact_resume.py`` (as a subprocess, also under DDP) and by the demo.
Dropout, a shuffled ``RandomSampler`` (Lightning swaps in a ``DistributedSampler`` under
DDP), a per-step LR schedule, gradient accumulation and a torchmetrics metric logged
``on_epoch`` make any difference from an uninterrupted run visible.

Writes into ``--status``: ``rank{R}.pid``; ``rank{R}.step`` (global step after each
batch); ``rank{R}.batches.jsonl`` (one line per trained batch, appended across restarts:
step, epoch, batch index, sample indices); and on a normal exit ``rank{R}.weights.pt``
(state dict) and ``rank{R}.result.json`` (final step, epoch metrics, timeline of the
preemption callback and save timings).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO


class DropoutModel(L.LightningModule):
    def __init__(
        self, status: str = "", step_sleep: float = 0.0, width: int = 64, sigterm_at: tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )
        self.train_mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y, idx = batch
        pred = self.net(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        self.train_mse(pred.detach(), y)
        self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=False)
        self._maybe_sigterm()
        if self.hparams.step_sleep:
            time.sleep(self.hparams.step_sleep)
        if self.hparams.status:
            # Written here, not in on_train_batch_end: a preemption exits from the callback's
            # on_train_batch_end, before the module's runs, but this batch was trained.
            rec = {
                "step": self.global_step,
                "epoch": self.current_epoch,
                "batch_idx": batch_idx,
                "idx": idx.tolist(),
                "x": x.double().sum().item(),  # the inputs themselves (augmented in the workers with --aug)
            }
            with open(os.path.join(self.hparams.status, f"rank{self.global_rank}.batches.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
        return loss

    def _maybe_sigterm(self) -> None:
        """--sigterm-at N: a real SIGTERM to ourselves while step N trains (once per N, across
        restarts), so the snapshot holds exactly N steps: epoch boundaries are hit exactly."""
        n = self.global_step + 1
        if n not in self.hparams.sigterm_at or not self.hparams.status:
            return
        marker = os.path.join(self.hparams.status, f"rank{self.global_rank}.sigterm-{n}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        status = self.hparams.status
        if not status:
            return
        path = os.path.join(status, f"rank{self.global_rank}.step")
        with open(path + ".tmp", "w") as f:
            f.write(str(self.trainer.global_step))
        os.replace(path + ".tmp", path)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return TensorDataset(x, y, torch.arange(n))


class AugmentedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Adds noise drawn from the global torch RNG of the process that loads the sample:
    in worker processes that RNG is seeded from the loader's base seed, so a resume that
    starts workers with another base seed trains on other inputs."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, y, idx = self.inner[i]
        return x + 0.1 * torch.randn_like(x), y, idx


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """An iterable dataset: its position cannot be resumed by a sampler."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (self.inner[i] for i in range(len(self.inner)))


def make_loader(args: argparse.Namespace) -> Any:
    """The training loader the flags ask for (--stateful, --generator, --sampler, --aug, --iterable)."""
    data: Any = dataset(args.n)
    if args.aug:
        data = AugmentedDataset(data)
    if args.iterable:
        data = Stream(data)
    kwargs: dict[str, Any] = {"batch_size": args.batch_size, "num_workers": args.workers}
    if args.generator:
        kwargs["generator"] = torch.Generator().manual_seed(args.generator)
    if args.sampler == "distributed" and not args.iterable:  # one replica of two; set_epoch reshuffles
        kwargs["sampler"] = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, seed=11)
    elif not args.iterable:
        kwargs["shuffle"] = True
    if args.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, **kwargs)
    return DataLoader(data, **kwargs)


class Reloading(L.LightningDataModule):
    """--reload: ``train_dataloader()`` makes a new loader each time Lightning asks (every epoch)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args

    def train_dataloader(self) -> Any:
        return make_loader(self.args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--every", type=int, default=None, help="periodic save every N steps")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", default="cpu", help="gpu: tests/gpu (dropout draws from the CUDA RNG)")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--n", type=int, default=96, help="dataset size")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--stateful", action="store_true", help="torchdata StatefulDataLoader")
    p.add_argument("--generator", type=int, default=0, help="loader generator=torch.Generator().manual_seed(N)")
    p.add_argument("--sampler", choices=["random", "distributed"], default="random")
    p.add_argument("--aug", action="store_true", help="random noise added in __getitem__ (in the workers)")
    p.add_argument("--iterable", action="store_true", help="an IterableDataset (position not resumable)")
    p.add_argument("--replay", action="store_true", help="exact.replay_worker_draws = True")
    p.add_argument("--sigterm-at", default="", help="comma list of N: SIGTERM ourselves while step N trains")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--amp", action="store_true", help="16-mixed with a GradScaler that grows every 3 steps")
    p.add_argument("--reload", action="store_true", help="a new loader every epoch (reload_dataloaders_every_n_epochs)")
    args = p.parse_args(argv)

    os.makedirs(args.status, exist_ok=True)
    faulthandler.register(signal.SIGUSR2)  # `kill -USR2 PID` dumps every thread's stack (hang diagnosis)
    L.seed_everything(1234, workers=True)
    sigterm_at = tuple(int(n) for n in args.sigterm_at.split(",") if n)
    model = DropoutModel(status=args.status, step_sleep=args.step_sleep, width=args.width, sigterm_at=sigterm_at)
    cb = PreemptionCallback(args.dirpath, every_n_train_steps=args.every, keep_last_n=2, grace_period_s=30)
    cb.exact.enabled = os.environ.get("LP_EXACT", "1") != "0"  # the tests check that turning it off shows
    cb.exact.replay_worker_draws = args.replay
    io = ShardedAsyncCheckpointIO()
    plugins: list[Any] = [io]
    if args.amp:
        from lightning.pytorch.plugins import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=3)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        callbacks=[cb],
        plugins=plugins,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        accumulate_grad_batches=args.accumulate,
        deterministic=True,
        reload_dataloaders_every_n_epochs=1 if args.reload else 0,
    )
    with open(os.path.join(args.status, f"rank{trainer.global_rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    loader = make_loader(args)
    started = time.monotonic()
    rank = trainer.global_rank
    try:
        if args.reload:
            trainer.fit(model, datamodule=Reloading(args))
        else:
            trainer.fit(model, loader)
    finally:  # also when preempted: one line per start, for the tests and the demo
        run = {
            "resumed_from": cb.resumed_from,
            "exact": cb.exact.restored,
            "end_step": trainer.global_step,
            "timeline": [(event, t - started) for event, t in cb.timeline],
            "saves": [{"step": r.step, "blocking_s": r.blocking_s, "committed_s": r.committed_s} for r in io.history],
        }
        with open(os.path.join(args.status, f"rank{rank}.runs.jsonl"), "a") as f:
            f.write(json.dumps(run) + "\n")
    torch.save(model.state_dict(), os.path.join(args.status, f"rank{rank}.weights.pt"))
    result = {
        "step": trainer.global_step,
        "epoch_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "resumed_from": cb.resumed_from,
        "exact": cb.exact.restored,
        "scale": float(trainer.precision_plugin.scaler.get_scale()) if args.amp else None,  # type: ignore[attr-defined]
        "wall_s": time.monotonic() - started,
        "saves": [{"step": r.step, "blocking_s": r.blocking_s, "committed_s": r.committed_s} for r in io.history],
    }
    with open(os.path.join(args.status, f"rank{rank}.result.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
