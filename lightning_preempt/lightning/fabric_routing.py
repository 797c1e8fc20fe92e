"""Fabric's saves through our plugin on every rank, with the modules' and optimizers' states sharded.

``fabric.save(path, state)`` reaches ``Strategy.save_checkpoint`` of Fabric's strategy on
every rank (it must be called on all of them). The base implementation, used by
``SingleDeviceStrategy``, ``DDPStrategy`` (``ddp``, ``ddp_spawn``, ``ddp_fork``,
``ddp_notebook``) and ``DataParallelStrategy``, turns the modules and optimizers in
``state`` into state dicts and hands the result to the ``CheckpointIO`` on global rank 0
alone, which then writes every byte while the other ranks wait at Fabric's barrier.

With our plugin installed on the strategy, every rank hands its state to the plugin
instead: the replicated tensors are split between the ranks (each writes ~1/N, DCP), the
per-rank rest stays per rank, and the manifest commits the checkpoint once all ranks'
files are durable. Which top-level keys held a module or an optimizer is known here, before
the conversion; those keys are sharded without the user naming them in ``sharded_keys``.

Installed once per process by the plugin's constructor (a class-level wrap of Fabric's
base ``Strategy.save_checkpoint``, ``_compat.route_fabric_saves``); a strategy with another
``CheckpointIO`` keeps Lightning's behaviour. Strategies that override ``save_checkpoint``
(FSDP, ModelParallel, DeepSpeed, XLA) are not affected: they write with their own code.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch.nn import Module
from torch.optim import Optimizer

from lightning_preempt.collective import groups as pdist
from lightning_preempt.lightning import _compat


class FabricSaves(Protocol):
    """What a ``CheckpointIO`` offers to take Fabric's saves on every rank (our plugin)."""

    def fabric_state(self, sharded_keys: tuple[str, ...]) -> AbstractContextManager[None]: ...

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None: ...


def stateful_keys(state: dict[str, Any]) -> tuple[str, ...]:
    """The top-level keys of a ``fabric.save`` state that hold a module or an optimizer."""
    return tuple(str(k) for k, v in state.items() if isinstance(v, (Module, Optimizer)))


def wrap_save(original: Callable[..., None]) -> Callable[..., None]:
    """Fabric's ``Strategy.save_checkpoint``, routed to a plugin that offers ``fabric_state``."""

    def save_checkpoint(
        self: Any, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        io = self.checkpoint_io
        # Looked up on the class: a ``Mock()`` checkpoint_io (Lightning's own tests) grows any
        # attribute, and must see Lightning's calls.
        if getattr(type(io), "fabric_state", None) is None:
            original(self, path, state, storage_options, filter)
            return
        sharded = stateful_keys(state)
        converted = _compat.convert_fabric_state(self, state, filter or {})
        if pdist.world_size() > 1 or self.is_global_zero:
            # Through ``save_checkpoint``, the CheckpointIO contract (a subclass overriding it,
            # or a test mocking it, sees the save); ``fabric_state`` says it is Fabric's.
            with io.fabric_state(sharded):
                io.save_checkpoint(checkpoint=converted, path=path, storage_options=storage_options)

    return save_checkpoint
