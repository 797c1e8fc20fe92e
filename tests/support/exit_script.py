"""A job that records what ran on its way out (tests/e2e/test_exit_paths.py).

Every hook a user can register writes one line to ``--marks``: a callback's ``on_exception``
(Lightning 2.6 calls no ``LightningModule.on_exception`` for an exception in ``fit``), a logger's ``finalize``, a ``finally`` around ``fit``, an
``atexit`` handler, and ``module teardown`` from the ``__del__`` of a module global, which
only CPython's interpreter teardown runs (the part the quick exit leaves out). A user's file
object, ``user.log`` in the working directory, gets 8 lines and is never closed: they sit in
its buffer until something flushes it.

    --mode preempt   SIGTERM to itself at step 5: the callback snapshots and exits
    --mode catch     the same, but the script catches Preempted and goes on, exiting 0
    --mode after-fit fit ends normally, prints FIT-RETURNED and sleeps (the test signals it)
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import Preempted, PreemptionCallback, ShardedAsyncCheckpointIO

p = argparse.ArgumentParser()
p.add_argument("--dirpath", required=True)
p.add_argument("--marks", required=True)
p.add_argument("--mode", choices=("preempt", "catch", "after-fit"), required=True)
args = p.parse_args()
MARKS = os.open(args.marks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def mark(what: str) -> None:
    os.write(MARKS, f"{what}\n".encode())


class Teardown:
    """Its ``__del__`` runs only when the interpreter clears this module at exit."""

    def __init__(self) -> None:
        self.write, self.fd = os.write, MARKS

    def __del__(self) -> None:
        self.write(self.fd, b"module teardown\n")


TEARDOWN = Teardown()
USER_LOG = open("user.log", "w")  # noqa: SIM115  (left open, as a user's script might)
for line in range(8):
    USER_LOG.write(f"user line {line}\n")
atexit.register(mark, "atexit")


class MarkLogger(Logger):
    @property
    def name(self) -> str:
        return "marks"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *a: Any, **k: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def finalize(self, status: str) -> None:
        mark(f"logger finalize {status}")


class MarkCallback(L.Callback):
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        mark(f"callback on_exception {type(exception).__name__}")


class Job(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if args.mode != "after-fit" and self.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit() -> None:
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=MarkLogger(),
                        callbacks=[MarkCallback(), PreemptionCallback(args.dirpath, every_n_train_steps=4)],
                        plugins=[ShardedAsyncCheckpointIO()], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    try:
        trainer.fit(Job(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
    finally:
        mark("finally")


if args.mode == "catch":
    try:
        fit()
    except Preempted as exc:
        mark(f"caught {exc.code}")
    mark("went on")
    sys.exit(0)
fit()
if args.mode == "after-fit":
    print("FIT-RETURNED", flush=True)
    time.sleep(60)
    mark("slept to the end")
