"""A Fabric loop over sample indices, for the resize test (tests/e2e/test_fabric.py).

Fabric's ``ddp`` strategy on ``--devices`` CPU ranks (gloo), launched by Fabric itself; the
data is ``TensorDataset(arange(N))`` behind a shuffled ``DataLoader`` (Fabric injects its
``DistributedSampler``), so every batch names the samples it trained. Each rank appends one
JSON line per optimizer step to ``--status``/``rank{R}.trained`` (``{"step", "epoch",
"indices"}``) and writes ``rank{R}.exit`` and ``rank{R}.result.json`` (start step, final
step, how the data position was restored). ``--signal-at N``: rank 0 sends itself SIGTERM
after step N.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.fabric import Preemption

N, BATCH = 96, 4


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--signal-at", type=int, default=None)
    args = p.parse_args(argv)
    status = Path(args.status)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="ddp", plugins=[ShardedAsyncCheckpointIO()])
    fabric.launch()
    rank = fabric.global_rank
    code = 0
    try:
        fabric.seed_everything(7)
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH, shuffle=True))
        preempt = Preemption(fabric, dirpath=args.dirpath, grace_period_s=60, lease_timeout_s=5)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        preempt.resume(state)
        start = state["step"]
        with open(status / f"rank{rank}.trained", "a") as trained:
            for (batch,) in preempt.iterate(loader, state, max_epochs=args.epochs):
                optimizer.zero_grad()
                model(batch.float().unsqueeze(1)).sum().backward()
                optimizer.step()
                state["step"] += 1
                trained.write(
                    json.dumps({"step": state["step"], "epoch": preempt.epoch, "indices": batch.tolist()}) + "\n"
                )
                trained.flush()
                if state["step"] == args.signal_at and rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
        preempt.finish(state)
        result = {"start_step": start, "step": state["step"], "restored": preempt.data.restored}
        (status / f"rank{rank}.result.json").write_text(json.dumps(result))
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
        raise
    finally:
        (status / f"rank{rank}.exit").write_text(str(code))
    return 0


if __name__ == "__main__":
    sys.exit(main())
