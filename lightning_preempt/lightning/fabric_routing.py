"""Fabric's saves through our plugin on every rank, with the modules' and optimizers' states sharded.

Fabric's base ``Strategy.save_checkpoint`` (single device, DDP, DP) hands the state to the
``CheckpointIO`` on rank 0 alone. With our plugin every rank hands its state to it, so the
replicated tensors are split between the ranks (DCP) and the keys that held a module or
optimizer are sharded without naming them. Installed once per process by the plugin
(``_compat.route_fabric_saves``); strategies that override ``save_checkpoint`` are unaffected.
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
