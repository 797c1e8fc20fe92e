"""The worker of the elastic tests: one rank per torchrun agent ("node"), gloo on CPU.

Reads its world from torchrun's environment (``lightning_preempt.elastic.trainer_kwargs``)
and writes, per start of a worker (``a{attempt}`` = the ``TORCHELASTIC_RESTART_COUNT`` and
the pid, so restarts never overwrite each other), into ``--status``:

* ``<node>.pid`` / ``<node>.step``: the worker's pid and its global step after each batch
  (the test signals a chosen node at a known step);
* ``<node>.<pid>.start.json``: world size, rank, restart count, the step training started
  at and a SHA-256 of the weights then;
* ``<node>.<pid>.exit.json``: the exit code, the step and the weights' SHA-256 at exit
  (after a preemption these are the snapshot's step and weights);
* with ``--loaders``: four training loaders at once (:data:`LOADERS`: the sampler Lightning
  injects and ``StatefulDataLoader(shuffle=True)``, each with and without a worker process)
  and ``<node>.<pid>.samples.jsonl``, one line per trained batch: epoch, step, world size and
  each loader's sample indices; the start records add the epoch and the batch of the epoch.

``<node>`` is ``--name`` (the simulated node's name, stable across restarts; ranks are not).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from models import TinyModel, data
from torch.utils.data import DataLoader

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning
from lightning_preempt.elastic import trainer_kwargs


def weights_sha(model: torch.nn.Module) -> str:
    return state_sha(model.state_dict())


def state_sha(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names and bytes of a state dict (a model's, or a checkpoint's ``state_dict``)."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# name -> (StatefulDataLoader, num_workers); each yields (x, y, index) batches of 8
LOADERS = {"dataloader": (False, 0), "dataloader-workers": (False, 1), "stateful": (True, 0),
           "stateful-workers": (True, 1)}  # fmt: skip


def indexed_loaders(n: int) -> dict[str, Any]:
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin(), torch.arange(n))
    return {
        name: (StatefulDataLoader if stateful else DataLoader)(data, batch_size=8, shuffle=True, num_workers=workers)
        for name, (stateful, workers) in LOADERS.items()
    }


class IndexModel(TinyModel):
    """Trains on the first loader's batch; records every loader's sample indices (see the module docstring)."""

    def __init__(self, samples: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.samples = samples

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        # Written here, not in on_train_batch_end: a preemption exits from the callback's
        # on_train_batch_end, before the module's runs, but this batch was trained.
        rec = {"epoch": self.current_epoch, "step": self.global_step, "world": self.trainer.world_size,
               "idx": {name: b[2].tolist() for name, b in batch.items()}}  # fmt: skip
        with open(self.samples, "a") as f:
            f.write(json.dumps(rec) + "\n")
        x, y, _ = batch["dataloader"]
        return super().training_step((x, y), batch_idx)


class Status(Callback):
    """Writes what the elastic tests assert on (see the module docstring)."""

    def __init__(self, status: str, node: str) -> None:
        self.dir = status
        self.node = node
        self.prefix = os.path.join(status, f"{node}.{os.getpid()}")
        os.makedirs(status, exist_ok=True)
        self._write(os.path.join(status, f"{node}.pid"), str(os.getpid()))

    def _write(self, path: str, text: str) -> None:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        info = {
            "node": self.node,
            "pid": os.getpid(),
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "start_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "batch_in_epoch": int(trainer.fit_loop.epoch_loop.batch_progress.current.ready),
            "weights": weights_sha(pl_module),
            "time": time.time(),
        }
        self._write(self.prefix + ".start.json", json.dumps(info))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._write(os.path.join(self.dir, f"{self.node}.step"), str(trainer.global_step))

    def finish(self, trainer: L.Trainer, model: torch.nn.Module, code: int | str | None) -> None:
        info = {"code": code, "step": trainer.global_step, "weights": weights_sha(model), "time": time.time()}
        self._write(self.prefix + ".exit.json", json.dumps(info))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--local-dirpath", default=None)
    p.add_argument("--grace", type=float, default=30.0)
    p.add_argument("--replica", action="store_true", help="add PeerReplica (two tiers across nodes)")
    p.add_argument("--width", type=int, default=16, help="hidden width: the state is ~40 x width bytes")
    p.add_argument("--loaders", type=int, default=0, help="N samples: train on LOADERS, record their indices")
    p.add_argument("--global-batch", default="per_rank")
    args = p.parse_args(argv)
    if os.environ.get("LP_SLOW_DIR"):
        import throttled_fs  # noqa: F401  (registers slow://: a remote behind a bandwidth limit)

    L.seed_everything(0, workers=True)
    status = Status(args.status, args.name)
    if args.loaders:
        model: TinyModel = IndexModel(status.prefix + ".samples.jsonl", width=args.width, step_sleep=args.step_sleep)
    else:
        model = TinyModel(width=args.width, step_sleep=args.step_sleep)
    cb = PreemptionCallback(
        args.dirpath,
        every_n_train_steps=args.every,
        keep_last_n=3,
        grace_period_s=args.grace,
        local_dirpath=args.local_dirpath,
        tuning=Tuning(agree_every_n_steps=1, lease_timeout_s=20, global_batch=args.global_batch),
    )
    callbacks: list[Callback] = [cb, status]
    if args.replica:
        from lightning_preempt.lightning.peer_replica import PeerReplica

        callbacks.append(PeerReplica())
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        strategy="ddp",
        callbacks=callbacks,
        plugins=[ShardedAsyncCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        deterministic=True,
        **trainer_kwargs(),
    )
    loader: Any = indexed_loaders(args.loaders) if args.loaders else DataLoader(data(256), batch_size=8, shuffle=False)
    try:
        trainer.fit(model, loader)
    except SystemExit as exc:
        status.finish(trainer, model, exc.code)
        raise
    status.finish(trainer, model, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
