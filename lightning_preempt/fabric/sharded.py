"""Fabric's sharded strategies through the plugin: ``ModelParallelStrategy`` (FSDP2, tensor
parallel) and ``FSDPStrategy`` (FSDP1). Both write DCP shards with no commit (the first refuses a
``CheckpointIO``): each gets a plugin of its own, and ``fabric.save``/``fabric.load`` rebound on
the instance so every rank hands its sharded state dicts to it, and ours load in place,
resharded (as lightning/sharded_saves.py does for the Trainer).

FSDP1 must shard its state as DTensors, which it does when it has a device mesh: Fabric wraps
the model before ``Preemption`` exists, so the mesh is the user's
(``FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(num_nodes, devices))``: Fabric makes
a mesh of that tuple; with FULL_SHARD it would switch to NO_SHARD); a module without one is
refused with a HINT before step 1.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import FSDPStrategy
from torch.nn import Module
from torch.optim import Optimizer

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.format.skeleton import split_checkpoint
from lightning_preempt.lightning import _compat
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO, fabric_order
from lightning_preempt.lightning.sharded_saves import optimizer_templates, without_mesh
from lightning_preempt.lightning.strategies import hand_options
from lightning_preempt.resume.samplers import is_stateful

__all__ = ["check", "own_plugin"]


def own_plugin(strategy: Any, config: PreemptionConfig) -> ShardedAsyncCheckpointIO:
    """The plugin this sharded ``strategy`` saves and loads through (made and routed once)."""
    owned = getattr(strategy, "_lightning_preempt_io", None)
    if owned is None:
        owned = hand_options(ShardedAsyncCheckpointIO(tuning=config.tuning), config)
        _install(strategy, owned)
        strategy._lightning_preempt_io = owned
    return owned  # type: ignore[no-any-return]


def check(strategy: Any, state: dict[str, Any]) -> None:
    """Every rank, before step 1: refuse an FSDP1 module whose state we could not save."""
    if isinstance(strategy, FSDPStrategy):
        _check_mesh(_module_of(state))


def _module_of(state: dict[str, Any]) -> Module:
    modules = [v for v in state.values() if isinstance(v, Module)]
    if len(modules) != 1:
        raise ValueError(
            f"lightning_preempt: a sharded strategy saves and loads a state with exactly one module, got "
            f"{len(modules)}\nHINT: put the model set up with fabric.setup_module under one key, e.g. state['model']."
        )
    return modules[0]


def _check_mesh(module: Module) -> None:
    """FSDP1 modules must have a device mesh: without one their state is ``ShardedTensor``."""
    if without_mesh(module):
        raise ValueError(
            "lightning_preempt: Fabric's FSDPStrategy without a device mesh shards the state as ShardedTensor, "
            "which lightning_preempt does not save\nHINT: pass device_mesh=(num_nodes, devices_per_node) and "
            "sharding_strategy='HYBRID_SHARD' to FSDPStrategy (on one node: (1, devices), which shards as "
            "FULL_SHARD does): its state is then DTensors, saved and resharded."
        )


def _sharded_states(strategy: Any, state: dict[str, Any], *, optimizers: bool = True) -> dict[str, Any]:
    """The modules' and (``optimizers``) optimizers' sharded state dicts, by the keys of ``state``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    check(strategy, state)
    module = _module_of(state)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Module):
            out[key] = get_model_state_dict(value)
        elif isinstance(value, Optimizer) and optimizers:
            # A fresh optimizer has no state to load into: this materialises it (DCP's
            # _init_optim_state), so a load fills every entry.
            out[key] = get_optimizer_state_dict(module, value)
    return out


def _install(strategy: Any, io: ShardedAsyncCheckpointIO) -> None:
    """Route ``strategy``'s ``save_checkpoint``/``load_checkpoint`` through ``io`` (every rank):
    every rank hands its sharded state dicts to the plugin; ours load in place, resharded, other
    paths go to Lightning."""
    original_load = strategy.load_checkpoint

    def save(self: Any, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None) -> None:
        if filter is not None:
            raise NotImplementedError(f"lightning_preempt: fabric.save(filter=...) with {type(self).__name__}\n"
                                      "HINT: save the whole state; filter when exporting it.")  # fmt: skip
        path = self.broadcast(str(path))  # every rank writes its shards into one checkpoint
        converted = {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}
        converted.update(_sharded_states(self, state))
        order = fabric_order(io, path, storage_options, state)
        io.save_checkpoint(checkpoint=converted, path=path, storage_options=order)

    def load(self: Any, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> Any:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = self.broadcast(str(path))
        resolved = agree.decide(lambda: io.resolve(path), pdist.world_group(), what="resolving the checkpoint")
        if resolved is None or not isinstance(state, dict) or not state:
            return original_load(path, state, strict, weights_only)
        # FSDP1: the optimizers' templates from the checkpoint, not from their state dicts, which
        # all-gather every flat parameter's state (lightning/sharded_saves.py optimizer_templates).
        fsdp1 = isinstance(self, FSDPStrategy)
        templates = _sharded_states(self, state, optimizers=not fsdp1)
        flat, _ = split_checkpoint(templates, tuple(templates))
        optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer)]
        template_for = None
        if fsdp1 and optimizer_keys:
            model_key = next(k for k, v in state.items() if isinstance(v, Module))
            template_for = optimizer_templates(flat, model_key, optimizer_keys)
        checkpoint = io.load_sharded(resolved, flat, template_for=template_for)
        missing = [k for k in state if k not in checkpoint]
        if strict and missing:
            raise KeyError(f"The requested state contains a key '{missing[0]}' that does not exist in the loaded "
                           "checkpoint. To disable strict loading, set `strict=False`.")  # fmt: skip
        module = _module_of(state)
        options = StateDictOptions(strict=strict, cpu_offload=not isinstance(self, FSDPStrategy))
        for key, value in list(state.items()):
            if key not in checkpoint:
                continue
            if isinstance(value, Module):
                set_model_state_dict(value, checkpoint.pop(key), options=options)
            elif isinstance(value, Optimizer):
                set_optimizer_state_dict(module, value, optim_state_dict=checkpoint.pop(key), options=options)
            elif is_stateful(value):
                value.load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint

    _compat.rebind(strategy, "fabric_sharded", save_checkpoint=save, load_checkpoint=load)
