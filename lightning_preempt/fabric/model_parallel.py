"""Fabric's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallel) through our plugin.

That strategy refuses a ``CheckpointIO`` and writes DCP shards with no commit, so
:class:`~lightning_preempt.fabric.Preemption` owns a plugin for it and rebinds
``save_checkpoint`` (every rank hands its sharded state dicts to the plugin) and
``load_checkpoint`` (ours load in place, resharded; other paths go to Lightning) on the
strategy instance, as ``lightning/strategies.py`` does for the Trainer. Works on CPU (gloo).
"""

from __future__ import annotations

import types
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.format.skeleton import split_checkpoint
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.lightning.fabric_routing import stateful_keys
from lightning_preempt.resume.samplers import is_stateful


def _module_of(state: dict[str, Any]) -> Module:
    modules = [v for v in state.values() if isinstance(v, Module)]
    if len(modules) != 1:
        raise ValueError(
            f"lightning_preempt: ModelParallelStrategy saves and loads a state with exactly one module, got "
            f"{len(modules)}\nHINT: put the model set up with fabric.setup_module under one key, e.g. state['model']."
        )
    return modules[0]


def _sharded_states(state: dict[str, Any]) -> dict[str, Any]:
    """The modules' and optimizers' sharded state dicts, by the keys of ``state``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    module = _module_of(state)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Module):
            out[key] = get_model_state_dict(value)
        elif isinstance(value, Optimizer):
            out[key] = get_optimizer_state_dict(module, value)
    return out


def install(strategy: Any, io: ShardedAsyncCheckpointIO) -> None:
    """Route ``strategy``'s ``save_checkpoint``/``load_checkpoint`` through ``io`` (every rank)."""
    original_load = strategy.load_checkpoint

    def save(self: Any, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None) -> None:
        if filter is not None:
            raise NotImplementedError("lightning_preempt: fabric.save(filter=...) with ModelParallelStrategy\n"
                                      "HINT: save the whole state; filter when exporting it.")  # fmt: skip
        path = self.broadcast(str(path))  # every rank writes its shards into one checkpoint
        converted = {k: (v.state_dict() if is_stateful(v) else v) for k, v in state.items()}
        converted.update(_sharded_states(state))
        with io.fabric_state(stateful_keys(state)):
            io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

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
        templates = _sharded_states(state)
        flat, _ = split_checkpoint(templates, tuple(templates))
        checkpoint = io.load_sharded(resolved, flat)
        missing = [k for k in state if k not in checkpoint]
        if strict and missing:
            raise KeyError(f"The requested state contains a key '{missing[0]}' that does not exist in the loaded "
                           "checkpoint. To disable strict loading, set `strict=False`.")  # fmt: skip
        module = _module_of(state)
        options = StateDictOptions(strict=strict, cpu_offload=True)
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

    strategy.save_checkpoint = types.MethodType(save, strategy)
    strategy.load_checkpoint = types.MethodType(load, strategy)
