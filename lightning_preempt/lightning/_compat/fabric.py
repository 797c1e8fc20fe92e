"""Fabric's private names and patches (the list of every patch: ``_compat/__init__.py``);
each shim says what happens when the name is missing (all private uses: docs/compat.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_preempt.lightning._compat.trainer import wrap_once


# ---- Fabric: fabric.save through our plugin on every rank (checkpoint_io.wrap_save) ----
def route_fabric_saves(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Wrap Fabric's base ``Strategy.save_checkpoint`` once per process (public method, so
    this only names the class's module). Missing: rank 0 writes alone, as Lightning does."""
    wrap_once("lightning.fabric.strategies.strategy", "Strategy", "save_checkpoint", wrap)


def convert_fabric_state(strategy: Any, state: dict[str, Any], filter: dict[str, Any]) -> dict[str, Any]:
    """Fabric's own conversion of modules, optimizers and ``_Stateful`` objects in a
    ``fabric.save`` state into state dicts, with its ``filter`` applied.

    Private: ``Strategy._convert_stateful_objects_in_state`` (Lightning 2.5-2.6).
    """
    return strategy._convert_stateful_objects_in_state(state, filter=filter)  # type: ignore[no-any-return]


def fabric_save(fabric: Any, state: dict[str, Any], order: Any) -> None:
    """``fabric.save(order.url, state)`` with ``order`` (save/order.py) as the strategy's
    ``storage_options``, which ``fabric.save`` does not take: its own two steps, the unwrap of
    Fabric's module/optimizer wrappers and the barrier after the strategy's save.

    Private: ``lightning.fabric.wrappers._unwrap_objects`` (Lightning 2.5-2.6). Missing:
    ``fabric.save`` (the save is then a user's: watched, overlapped whatever its kind).
    """
    try:
        from lightning.fabric.wrappers import _unwrap_objects
    except ImportError:  # pragma: no cover - moved in a newer Lightning
        fabric.save(order.url, state)
        return
    fabric.strategy.save_checkpoint(order.url, _unwrap_objects(state), storage_options=order)
    fabric.barrier()


def fabric_loader_parts(loader: Any) -> tuple[Any, Any]:
    """``(the DataLoader, the device its batches go to or None)`` of a loader given to a
    Fabric loop: Fabric's ``setup_dataloaders`` wrapper, or a plain loader (no device).

    Private: ``_FabricDataLoader._dataloader`` (Lightning 2.5-2.6; ``device`` is public).
    Missing: the wrapper itself is iterated, and its data position cannot be resumed.
    """
    inner = getattr(loader, "_dataloader", None)
    if inner is None:
        return loader, None
    return inner, getattr(loader, "device", None)
