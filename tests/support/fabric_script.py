"""A hand-written Fabric loop under ``Preemption`` (tests/e2e/test_fabric.py).

A small GPT-like model (examples/fabric_train.py's) on synthetic tokens, dropout on, a
shuffled plain ``DataLoader`` (a ``DistributedSampler`` under DDP). Writes per rank to
``--status``: ``rank{R}.pid``, ``rank{R}.step`` after every step, ``rank{R}.exit`` (the exit
code) and ``rank{R}.result.json`` (start step, final step, a digest of the weights).
``--signal-at N``: rank ``--signal-rank`` sends itself SIGTERM after step N.

``--indices`` (the resize test): ``Linear(1, 1)`` over ``TensorDataset(arange(N))`` instead,
so every batch names its samples; each rank also appends one JSON line per optimizer step
to ``rank{R}.trained`` (``{"step", "epoch", "indices"}``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_preempt import ShardedAsyncCheckpointIO, Tuning
from lightning_preempt.fabric import Preemption

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fabric_train import TinyGPT, synthetic_tokens

N = 96  # --indices: samples, in batches of 4


def shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        t = t.full_tensor() if isinstance(t, DTensor) else t  # collective: every rank digests
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal-rank", type=int, default=1)
    p.add_argument("--indices", action="store_true")
    args = p.parse_args(argv)
    status = Path(args.status)
    status.mkdir(parents=True, exist_ok=True)
    model_parallel = args.strategy in ("model_parallel", "fsdp", "fsdp_no_mesh")  # sharded: module set up alone
    if args.strategy == "model_parallel":  # FSDP2 (fully_shard) over the data-parallel ranks; takes no CheckpointIO plugin
        strategy: Any = ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=args.devices,
                                              tensor_parallel_size=1)  # fmt: skip
        fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    elif args.strategy in ("fsdp", "fsdp_no_mesh"):  # FSDP1 on CPU (tests/support/cpu_fsdp.py)
        from cpu_fsdp import fabric_cpu_fsdp

        # one node: hybrid sharding over a (1, N) mesh shards as FULL_SHARD does, its state DTensors
        mesh = {"device_mesh": (1, args.devices), "sharding_strategy": "HYBRID_SHARD"} if args.strategy == "fsdp" else {}
        fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=fabric_cpu_fsdp(**mesh))
    else:
        fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy,
                          plugins=[ShardedAsyncCheckpointIO()])  # fmt: skip
    fabric.launch()
    rank = fabric.global_rank
    (status / f"rank{rank}.pid").write_text(str(os.getpid()))
    code = 0
    try:
        fabric.seed_everything(7 if args.indices else 1234)
        model = torch.nn.Linear(1, 1) if args.indices else TinyGPT()
        optimizer = (torch.optim.SGD(model.parameters(), lr=1e-3) if args.indices
                     else torch.optim.AdamW(model.parameters(), lr=3e-3))  # fmt: skip
        if model_parallel:
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
        else:
            model, optimizer = fabric.setup(model, optimizer)
        data = TensorDataset(torch.arange(N)) if args.indices else synthetic_tokens()
        loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
        preempt = Preemption(fabric, dirpath=args.dirpath, every_n_train_steps=args.every, grace_period_s=60,
                             tuning=Tuning(lease_timeout_s=5))  # fmt: skip
        state = {"model": model, "optimizer": optimizer, "step": 0}
        if not args.indices:
            state["loader"] = loader
        preempt.resume(state)
        start = state["step"]
        for i, batch in enumerate(preempt.iterate(loader, state, max_epochs=args.epochs)):
            last = (i + 1) % args.accumulate == 0
            with fabric.no_backward_sync(model, enabled=not last):
                if args.indices:
                    loss = model(batch[0].float().unsqueeze(1)).sum()
                else:
                    logits = model(batch[0])
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))
                fabric.backward(loss / args.accumulate)
            if last:
                optimizer.step()
                optimizer.zero_grad()
                state["step"] += 1
                (status / f"rank{rank}.step").write_text(str(state["step"]))
                if args.indices:
                    line = {"step": state["step"], "epoch": preempt.epoch, "indices": batch[0].tolist()}
                    with open(status / f"rank{rank}.trained", "a") as trained:
                        trained.write(json.dumps(line) + "\n")
                if state["step"] == args.signal_at and rank == args.signal_rank:
                    os.kill(os.getpid(), signal.SIGTERM)
        preempt.finish(state)
        result = {"start_step": start, "step": state["step"], "weights": digest(model),
                  "resumed_from": preempt.resumed_from, "restored": preempt.data.restored}  # fmt: skip
        (status / f"rank{rank}.result.json").write_text(json.dumps(result))
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
        raise
    finally:
        (status / f"rank{rank}.exit").write_text(str(code))
    return 0


if __name__ == "__main__":
    sys.exit(main())
