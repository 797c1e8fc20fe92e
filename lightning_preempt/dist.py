"""Rank agreement helpers. Collectives that report errors instead of hanging.

Every helper takes an explicit process group so the background writer can use its own
gloo group and never touch the training group (mixing threads on one group deadlocks).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

import torch
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


class FlagAgreement:
    """All ranks learn, at the same step boundary, whether any rank raised a flag.

    :meth:`exchange` all-reduces a small int tensor with MAX on a gloo group (no device
    sync, no traffic on the training group). With ``overlap=True`` the reduction started at
    one boundary is read at the next, so the collective runs while the step computes;
    every rank still acts on the same result at the same boundary, one step later. Flags
    raised before the previous exchange are never lost: an overlapped result is OR-ed in.
    :meth:`exchange_now` completes any pending exchange and agrees synchronously.

    Every rank must make the same sequence of calls.
    """

    def __init__(self, group: ProcessGroup | None, width: int) -> None:
        self.group = group
        self.width = width
        self._pending: tuple[Any, torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return self.group is not None and is_distributed()

    def exchange(self, flags: list[int], overlap: bool = False) -> list[int]:
        """Agree on ``flags`` (MAX over ranks); overlapped: returns the previous boundary's result."""
        if not overlap:
            return self.exchange_now(flags)
        if not self.active:
            return [int(v) for v in flags]
        local = torch.tensor(flags, dtype=torch.int32)
        previous = self._pending
        work = dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, local)
        if previous is None:
            return [0] * self.width
        prev_work, prev_tensor = previous
        prev_work.wait()
        return [int(v) for v in prev_tensor.tolist()]

    def exchange_now(self, flags: list[int]) -> list[int]:
        """Complete a pending exchange and agree on ``flags`` right now."""
        earlier = self.flush()
        if not self.active:
            return [max(a, int(b)) for a, b in zip(earlier, flags, strict=True)]
        local = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return [max(a, int(b)) for a, b in zip(earlier, local.tolist(), strict=True)]

    def flush(self) -> list[int]:
        """Wait for an overlapped exchange (every rank, before leaving the loop)."""
        if self._pending is None:
            return [0] * self.width
        work, tensor = self._pending
        self._pending = None
        work.wait()
        return [int(v) for v in tensor.tolist()]
