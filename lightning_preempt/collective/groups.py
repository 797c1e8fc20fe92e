"""Rank agreement helpers. Collectives that report errors instead of hanging.

Every helper takes an explicit process group so the background writer can use its own
gloo group and never touch the training group (mixing threads on one group deadlocks).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def world_group() -> ProcessGroup | None:
    """The default group (the training group: call from the training thread only)."""
    return dist.group.WORLD if is_distributed() else None


def new_gloo_group(timeout_s: float = 600.0) -> ProcessGroup | None:
    """A CPU group for our own collectives. Collective: every rank must call it."""
    if not is_distributed():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def destroy_group(group: ProcessGroup | None) -> None:
    """Release a group made by :func:`new_gloo_group` (local; safe after the default group is gone)."""
    if group is None or not is_distributed():
        return
    with contextlib.suppress(RuntimeError, ValueError):  # already destroyed with the default group
        dist.destroy_process_group(group)


def all_gather_objects(obj: Any, group: ProcessGroup | None) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, …]`` on every rank (``[obj]`` without a group)."""
    if group is None or not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: ProcessGroup | None, src_rank: int = 0) -> Any:
    """Rank ``src_rank``'s ``obj`` on every rank of ``group``."""
    if group is None or not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src_rank), group=group)
    return box[0]

