"""All ranks learn, at the same step boundary, whether any rank raised a flag.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_preempt.collective.groups import ProcessGroup, is_distributed


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
        previous = self.flush()  # (started a step ago: done by now, in the common case)
        local = torch.tensor(flags, dtype=torch.int32)
        self._pending = (dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group, async_op=True), local)
        return previous

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

