"""Trainer strategies whose state is sharded: every rank hands its DTensor shards to the plugin.

Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) and ``FSDPStrategy`` (FSDP1)
bypass ``CheckpointIO``: they call DCP themselves and no manifest commits the result (and
FSDP1's ``load_checkpoint`` reads any file as a checkpoint). Here both get the same two methods,
rebound on the instance:

* ``save_checkpoint``: every rank gives its sharded state dict to the plugin, which stages,
  writes and commits it like any other save (one manifest, the commit last);
* ``load_checkpoint``: our checkpoints (the resume pointer, a committed directory) load in place,
  resharded to this world size; any other path goes to Lightning's own load.

FSDP1 also gets (docs/strategies.md):

* a device mesh over all ranks when it has none, before it wraps the model, so that its sharded
  state dict holds DTensors (which DCP reshards) rather than ``ShardedTensor`` (training is the
  same: a one-dimensional mesh over the world *is* the default process group);
* its state dicts taken through DCP's ``get_model_state_dict``/``get_optimizer_state_dict``
  whatever ``state_dict_type`` says: our saves never gather the model onto one rank
  (``lightning-preempt export`` makes the full file when one is wanted).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.format.skeleton import split_checkpoint
from lightning_preempt.lightning import _compat
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.read.load import TemplateFor
from lightning_preempt.save.order import SaveOrder

__all__ = ["check_sharding", "install_fsdp", "install_model_parallel", "optimizer_templates", "without_mesh"]

_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def install_model_parallel(strategy: ModelParallelStrategy, io: ShardedAsyncCheckpointIO) -> None:
    """Route ``ModelParallelStrategy``'s sharded saves and loads through ``io`` (every rank). Its
    ``save_distributed_checkpoint=False`` (the full state on rank 0) keeps Lightning's save."""
    _install(strategy, io, sharded=lambda: bool(strategy._save_distributed_checkpoint), offload=True)


def install_fsdp(strategy: FSDPStrategy, io: ShardedAsyncCheckpointIO) -> None:
    """Route ``FSDPStrategy``'s saves and loads through ``io`` (every rank), sharded whatever its
    ``state_dict_type``. Call before the strategy wraps the model (the callback's ``setup``)."""
    _give_a_mesh(strategy)

    def model_state(self: FSDPStrategy) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(_sharded_model(self))

    def optimizer_state(self: FSDPStrategy, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(_sharded_model(self), _compat.unwrap_optimizer(optimizer))

    # Both are called by Lightning's dump_checkpoint on every rank; Lightning's own gather the
    # full state to rank 0 for state_dict_type="full" (and would copy it to the CPU there).
    original_teardown = strategy.teardown

    def teardown(self: FSDPStrategy) -> None:
        original_teardown()
        # Lightning's FSDPStrategy.teardown skips Strategy.teardown, which tears the plugin down:
        # pending saves and drains would not be waited for (the final save never left the node).
        io.teardown()

    _compat.rebind(strategy, "fsdp1_state", lightning_module_state_dict=model_state, optimizer_state=optimizer_state,
                   teardown=teardown)  # fmt: skip
    # The staging copy moves the shards to host memory itself (into pinned buffers on CUDA).
    _install(strategy, io, sharded=lambda: True, offload=False)


def _install(strategy: Strategy, io: ShardedAsyncCheckpointIO, *, sharded: Callable[[], bool], offload: bool) -> None:
    original_save = strategy.save_checkpoint
    original_load = strategy.load_checkpoint

    def save(self: Strategy, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if not sharded():
            # full state on rank 0: Lightning's path (which refuses storage_options: the engine's order is ours)
            original_save(checkpoint, filepath, None if isinstance(storage_options, SaveOrder) else storage_options)
            return
        io.save_checkpoint(checkpoint, str(self.broadcast(str(filepath))), storage_options=storage_options)

    def load(self: Strategy, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        local = str(checkpoint_path)
        path = self.broadcast(local)
        # One rank looks at storage and decides; the rest get its answer or its error.
        resolved = agree.decide(lambda: io.resolve(path), pdist.world_group(), what="resolving the checkpoint")
        if resolved is None:
            return original_load(checkpoint_path, weights_only)  # type: ignore[no-any-return]
        # Each rank's resume pointer is its own file, aliased to the agreed checkpoint with the
        # fall-back past damage: loaded by that name where it means the same checkpoint.
        source = local if io.resolve(local) == resolved else resolved
        model = _sharded_model(self)
        model_state = get_model_state_dict(model)
        fsdp1 = isinstance(self, FSDPStrategy)
        if fsdp1:
            # FSDP1's optimizer state dict all-gathers every flat parameter's state (0.7 s of a
            # 1.4 s load at 256 MiB a rank) only to be overwritten: its templates come from the
            # checkpoint's keys and the parameters' DTensors instead (set_optimizer_state_dict
            # materialises a fresh optimizer's state itself).
            templates: dict[str, Any] = {"state_dict": model_state}
        else:
            # A fresh optimizer has no state to load into: get_optimizer_state_dict materialises it
            # (DCP's _init_optim_state: a step with zero gradients and lr 0) so every entry is loaded.
            templates = {
                "state_dict": model_state,
                "optimizer_states": [get_optimizer_state_dict(model, opt) for opt in self.optimizers],
            }
        flat, _ = split_checkpoint(templates)
        template_for: TemplateFor | None = None
        if fsdp1 and self.optimizers:
            template_for = optimizer_templates(flat, "state_dict", ["optimizer_states"])
        checkpoint = io.load_sharded(source, flat, template_for=template_for)
        assert self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        options = StateDictOptions(strict=strict, cpu_offload=offload)
        set_model_state_dict(model, checkpoint["state_dict"], options=options)
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            set_optimizer_state_dict(model, opt, optim_state_dict=state, options=options)
        return checkpoint

    _compat.rebind(strategy, "sharded_saves", save_checkpoint=save, load_checkpoint=load)


def optimizer_templates(model_flat: dict[str, Any], model_key: str, optimizer_keys: Collection[str]) -> TemplateFor:
    """Templates for FSDP1's sharded optimizer state (read/load.py ``TemplateFor``), each entry
    ``<optimizer key>[/<i>]/state/<parameter>/<name>`` of one of ``optimizer_keys``: a tensor of the
    parameter's shape (``<model_key>/<parameter>`` in ``model_flat``) is sharded as the parameter's
    DTensor, anything else (``step``) is whole on every rank, as ``get_optimizer_state_dict``
    makes them."""

    def template_for(key: str, shape: torch.Size, dtype: torch.dtype) -> Any:
        parts = key.split("/")
        if parts[0] not in optimizer_keys:
            return None  # the model's own tensors (only those it has are loaded) and other keys
        param = model_flat.get(f"{model_key}/{parts[-2]}") if len(parts) >= 4 and parts[-3] == "state" else None
        if param is not None and len(shape) > 0 and param.shape == shape:
            return torch.empty_like(param, dtype=dtype)
        return torch.empty(shape, dtype=dtype)

    return template_for


def _give_a_mesh(strategy: FSDPStrategy) -> None:
    """A device mesh for FSDP1 when the user gave none, so its sharded state holds DTensors."""
    kwargs = strategy.kwargs
    if kwargs.get("device_mesh") is not None:
        return  # the user's (Lightning makes a DeviceMesh of a tuple in setup_environment)
    if kwargs.get("process_group") is not None:
        raise ValueError(
            "lightning_preempt: FSDPStrategy(process_group=...) shards the state as ShardedTensor, which "
            "lightning_preempt does not save\nHINT: pass device_mesh=... instead of process_group "
            "(a 1-D mesh over the group's ranks; 2-D (replicate, shard) for hybrid sharding)."
        )
    if any(name in str(strategy.sharding_strategy) for name in _HYBRID):
        raise ValueError(
            f"lightning_preempt: FSDPStrategy({strategy.sharding_strategy}) without a device_mesh shards the "
            "state as ShardedTensor, which lightning_preempt does not save\n"
            "HINT: pass device_mesh=(num_nodes, devices_per_node) to FSDPStrategy."
        )
    from torch.distributed.device_mesh import init_device_mesh

    kwargs["device_mesh"] = init_device_mesh(strategy.root_device.type, (pdist.world_size(),))


def check_sharding(strategy: Strategy) -> None:
    """Every rank, once the strategy wrapped the model (before step 1): refuse an FSDP1 module
    without a device mesh (a user's own ``FullyShardedDataParallel(...)``), whose state we
    could not save or load."""
    if isinstance(strategy, FSDPStrategy) and strategy.model is not None:
        _sharded_model(strategy)


def _sharded_model(strategy: Strategy) -> torch.nn.Module:
    """The wrapped model, checked to shard its state as DTensors (or not at all)."""
    model = strategy.model
    assert model is not None
    if isinstance(strategy, FSDPStrategy) and without_mesh(model):
        raise ValueError(
            "lightning_preempt: a module was wrapped in FullyShardedDataParallel without a device mesh: its "
            "state is sharded as ShardedTensor, which lightning_preempt does not save\nHINT: wrap submodules "
            "with lightning's auto_wrap_policy or torch's wrap() inside configure_model (they take the "
            "strategy's mesh), or pass device_mesh= to every FullyShardedDataParallel you build."
        )
    return model


def without_mesh(module: torch.nn.Module) -> bool:
    """Whether an FSDP1 module in ``module`` has no device mesh: its sharded state dict then holds
    ``ShardedTensor`` (torch-private ``_device_mesh``, torch 2.7-2.13), not DTensors."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(getattr(m, "_device_mesh", None) is None for m in FullyShardedDataParallel.fsdp_modules(module))
