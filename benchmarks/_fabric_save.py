"""bench_save.py's Fabric rows: ``fabric.save(path, state)`` with a ``Fabric`` holding our plugin
against a ``Fabric`` with its default ``TorchCheckpointIO``, on the same bytes as the other rows.

The state is what a Fabric loop saves, ``{"model": module, "optimizer": optimizer, "step": n}``,
built on the benchmark checkpoint's own tensors (no copy): the module's parameters are its
``state_dict`` tensors and the SGD momentum buffers its ``optimizer_states`` ones, so a
``Bench.touch()`` changes this state too. ``fabric.save`` turns the module and optimizer into
state dicts first; that cost is in every Fabric row.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

Result = tuple[float, float | None, dict[str, float]]  # as bench_save.Result

#: key: (label, note), merged into bench_save.METHODS
METHODS: dict[str, tuple[str, str]] = {
    "fabric_ours": (
        "Fabric: fabric.save, ShardedAsyncCheckpointIO",
        "sharded_keys=('model', 'optimizer') named; committed = `.wait()`",
    ),
    "fabric_ours_default_keys": (
        "Fabric: fabric.save, ShardedAsyncCheckpointIO, default sharded_keys",
        "ShardedAsyncCheckpointIO() with no keys named (tensors outside sharded keys: skeleton)",
    ),
    "fabric_torch": ("Fabric: fabric.save, default TorchCheckpointIO", "sync torch.save as Fabric does it (no fsync)"),
}


class _Params(torch.nn.Module):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(t, requires_grad=True) for t in tensors)


def fabric_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A Fabric-style state sharing ``checkpoint``'s tensors (see the module docstring)."""
    module = _Params(list(checkpoint["state_dict"].values()))
    params = list(module.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    moments = [entry["momentum_buffer"] for entry in checkpoint["optimizer_states"][0]["state"].values()]
    for param, moment in zip(params, moments):  # as many as there are both (lightning_style_checkpoint: equal)
        optimizer.state[param]["momentum_buffer"] = moment
    return {"model": module, "optimizer": optimizer, "step": checkpoint["global_step"]}


class FabricSaves:
    """One ``Fabric`` per contender, built once (plugins keep their staging buffers between saves)."""

    def __init__(self, checkpoint: dict[str, Any], fresh: Any, thread_count: int | None) -> None:
        from lightning.fabric import Fabric

        from lightning_preempt import ShardedAsyncCheckpointIO

        threads = {} if thread_count is None else {"thread_count": thread_count}
        self.state = fabric_state(checkpoint)
        self.checkpoint = checkpoint
        self.fresh = fresh
        self.ours = ShardedAsyncCheckpointIO(sharded_keys=("model", "optimizer"), **threads)
        self.ours_default = ShardedAsyncCheckpointIO(**threads)
        self.fabrics = {
            "fabric_ours": Fabric(accelerator="cpu", devices=1, plugins=[self.ours]),
            "fabric_ours_default_keys": Fabric(accelerator="cpu", devices=1, plugins=[self.ours_default]),
            "fabric_torch": Fabric(accelerator="cpu", devices=1),
        }

    def runner(self, key: str) -> Any:
        fabric = self.fabrics[key]
        io = {"fabric_ours": self.ours, "fabric_ours_default_keys": self.ours_default}.get(key)

        def save() -> Result:
            self.state["step"] = self.checkpoint["global_step"]
            path = self.fresh(key)
            if io is None:
                path = os.path.join(path, "last.ckpt")
            t0 = time.perf_counter()
            fabric.save(path, self.state)
            t1 = time.perf_counter()
            if io is None:
                return t1 - t0, t1 - t0, {}
            io.wait()
            return t1 - t0, time.perf_counter() - t0, {}

        return save

    def close(self) -> None:
        self.ours.teardown()
        self.ours_default.teardown()
