"""A small real training job used by the tests (run as a subprocess, also under DDP).

Writes ``rank{R}.pid`` and ``rank{R}.step`` (the global step after each batch) into
``--status`` so a test can signal a chosen rank at a known step; ``rank{R}.exit`` with the
exit code; and after a normal end ``rank{R}.result.json`` with the start and final step
and a digest of the weights. ``--samples``: the data carries each sample's index and every
rank appends one JSON line per trained batch (epoch, step, world size, indices) to
``rank{R}.<pid>.samples.jsonl``, for the tests that check a resize trains every sample once.
``--signal-at`` makes the job SIGTERM itself at a precise
moment (a real signal, delivered by the kernel), for the edge cases.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from models import TinyModel, data, fit_reporting
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning


class SampleModel(TinyModel):
    """Trains on ``(x, y, index)`` batches and records the indices (``--samples``)."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        # Written here, not in on_train_batch_end: a preemption exits from the callback's
        # on_train_batch_end, before the module's runs, but this batch was trained.
        rec = {"epoch": self.current_epoch, "step": self.global_step, "world": self.trainer.world_size,
               "idx": batch[2].tolist()}  # fmt: skip
        path = os.path.join(self.hparams.status, f"rank{self.global_rank}.{os.getpid()}.samples.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return super().training_step(batch[:2], batch_idx)


class SelfSignal(Callback):
    """SIGTERM this process at a named moment: ``step:N``, ``validation``, ``sanity``,
    ``restore``, ``periodic-save`` (while the first periodic save is in flight) or
    ``double:N`` (at step N and again while the emergency snapshot is being written);
    ``kill:N`` sends SIGKILL at step N instead (an unannounced loss); ``ledger-kill:N`` too
    (before step N+1), once the goodput ledger has written what it was given (step N);
    ``saved-kill:N`` too (before step N+1), once every save made so far (a tier-0 copy of
    step N) committed."""

    def __init__(self, spec: str, rank: int | None, preemption: PreemptionCallback | None = None) -> None:
        self.phase, _, arg = spec.partition(":")
        self.arg = int(arg) if arg else 0
        self.rank = rank
        self.fired = 0
        self.preemption = preemption

    def _fire(self, trainer: L.Trainer) -> None:
        if self.rank is None or trainer.global_rank == self.rank:
            self.fired += 1
            if self.phase == "ledger-kill" and self.preemption is not None:
                assert self.preemption.engine.ledger.flush(30.0), "the ledger did not write within 30 s"
            if self.phase == "saved-kill" and self.preemption is not None:
                self.preemption.engine.saver.wait()
            os.kill(os.getpid(), signal.SIGKILL if self.phase.endswith("kill") else signal.SIGTERM)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        # After every callback's on_train_batch_end of step N (Lightning runs checkpoint
        # callbacks last): the ledger was given step N.
        if self.phase in ("ledger-kill", "saved-kill") and trainer.global_step == self.arg and not self.fired:
            self._fire(trainer)

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--dirpath-per-rank", action="store_true",
                   help="append -rank<LOCAL_RANK> to --dirpath, as a per-process run name would differ")  # fmt: skip
    p.add_argument("--status", default="")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
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
    p.add_argument("--cb-kwargs", default="{}", help="JSON: more PreemptionCallback options (tuning: a dict)")
    p.add_argument("--samples", action="store_true", help="record each trained batch's sample indices")
    p.add_argument("--ledger-progress-s", type=float, default=None, help="the ledger's last step seen, this often")
    args = p.parse_args(argv)
    if args.dirpath_per_rank:  # Lightning's launcher sets LOCAL_RANK in the ranks it starts
        args.dirpath = f"{args.dirpath}-rank{os.environ.get('LOCAL_RANK', '0')}"
    if args.ledger_progress_s is not None:
        import lightning_preempt.engine.ledger_writer as ledger

        ledger.PROGRESS_EVERY_S = args.ledger_progress_s
    if os.environ.get("LP_CHAOS_DIR"):
        import chaos_fs  # noqa: F401  (registers chaos://, the fault-injecting filesystem)

    L.seed_everything(0, workers=True)
    strategy: Any = args.strategy
    if args.strategy == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    elif args.strategy in ("fsdp", "fsdp_full"):  # FSDP1 on CPU (tests/support/cpu_fsdp.py)
        from cpu_fsdp import CPUFSDPStrategy

        strategy = CPUFSDPStrategy(state_dict_type="full" if args.strategy == "fsdp_full" else "sharded")
    kind = SampleModel if args.samples else TinyModel
    model = kind(width=args.width, step_sleep=args.step_sleep, status=args.status, dump_start=args.dump_start)
    options = json.loads(args.cb_kwargs)  # {"tuning": {...}}: Tuning's fields
    cb = PreemptionCallback(
        args.dirpath,
        every_n_train_steps=args.every,
        keep_last_n=3,
        grace_period_s=args.grace,
        local_dirpath=args.local_dirpath,
        storage_options=json.loads(args.storage_options),
        tuning=Tuning(agree_every_n_steps=args.agree_every, **options.pop("tuning", {})),
        **options,
    )
    callbacks: list[Callback] = [cb]
    if args.signal_at:
        callbacks.append(SelfSignal(args.signal_at, args.signal_rank, cb))
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
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
    train = data(args.data_size)
    if args.samples:
        train = TensorDataset(*train.tensors, torch.arange(args.data_size))
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=False)
    val = DataLoader(data(64, seed=1), batch_size=16)
    return fit_reporting(
        trainer,
        model,
        args.status,
        loader,
        val if args.val_every else None,
        ckpt_path=args.ckpt_path,
        extra=lambda: {"resumed_from": cb.resumed_from},
    )


if __name__ == "__main__":
    sys.exit(main())
