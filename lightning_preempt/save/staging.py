"""Staging: copy device tensors into reusable host buffers. No I/O here.

Buffers are allocated on the first save and reused by every later save of the same
shapes, so a steady-state save allocates no staging memory; that is also why at most
one save may be in flight (the writer reads these buffers until it commits). Buffers
are pinned when CUDA is present, so device-to-host copies run at full PCIe speed.

:meth:`HostStager.prepare` allocates and touches them ahead of time, on a background
thread, from the shapes alone: first touch of fresh memory (and pinning a 13 GB shard)
costs several times the copy itself, and the first save may be the emergency one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


class HostStager:
    """Copies ``{key: tensor}`` into host buffers that it owns and reuses.

    ``stage`` returns a dict of host tensors (``DTensor`` stays ``DTensor`` with a host
    local shard) that stays valid until the next ``stage`` call.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocated_bytes = 0
        self.last_staged_bytes = 0
        self._announced = False
        self._prep: Future[int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Buffers are a cache of host memory (possibly pinned, possibly GBs): a pickled or
        # copied stager (ddp_spawn workers, deepcopy of a trainer) starts empty instead.
        state = self.__dict__.copy()
        state["_buffers"] = {}
        state["allocated_bytes"] = 0
        state["last_staged_bytes"] = 0
        state["_prep"] = None
        return state

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def prepare(self, tensors: dict[str, torch.Tensor], *, background: bool = True) -> Future[int]:
        """Allocate and touch the buffers ``stage(tensors)`` will use, so that it only copies.

        Only shapes and dtypes are read from ``tensors`` (on the calling thread; no data is
        copied). A buffer that already fits is kept; one whose shape changed is replaced
        (the state grew, e.g. optimizer state created by the first step). With
        ``background`` a daemon thread does the work (allocation and the memset release
        the GIL); a ``stage`` meanwhile waits for it rather than allocating the same memory
        twice. The Future holds the bytes newly allocated.
        """
        specs = {key: _spec(t) for key, t in tensors.items()}
        self._wait_prepared()
        fut: Future[int] = Future()
        if not background:
            fut.set_result(self._allocate(specs))
            return fut
        self._prep = fut

        def run() -> None:
            try:
                fut.set_result(self._allocate(specs))
            except BaseException as err:  # e.g. out of (pinned) memory: stage() allocates itself
                fut.set_exception(err)

        threading.Thread(target=run, name="lightning_preempt-prealloc", daemon=True).start()
        return fut

    def _allocate(self, specs: dict[str, tuple[torch.Size, torch.dtype]]) -> int:
        added = 0
        for key, (shape, dtype) in specs.items():
            buf = self._buffers.get(key)
            if buf is not None and buf.shape == shape and buf.dtype == dtype:
                continue
            buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin_memory)
            buf.zero_()  # touch every page now, not inside the first (emergency) save
            self._buffers[key] = buf
            added += buf.numel() * buf.element_size()
        self.allocated_bytes += added
        return added

    def _wait_prepared(self) -> None:
        prep, self._prep = self._prep, None
        if prep is None:
            return
        err = prep.exception()
        if err is not None:
            log.warning("lightning_preempt: preallocating staging buffers failed (%s); the save allocates them", err)

    def stage(self, tensors: dict[str, torch.Tensor], *, keep: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into their buffers (see the class docstring); the buffers of keys
        neither in ``tensors`` nor in ``keep`` are dropped (the state lost them)."""
        self._wait_prepared()
        if not self._announced:
            kind = "pinned host memory" if self.pin_memory else "plain host memory (no CUDA: pinning unavailable)"
            log.info("lightning_preempt: staging checkpoints in reusable %s", kind)
            self._announced = True
        staged: dict[str, torch.Tensor] = {}
        needs_sync = False
        total = 0
        for key, tensor in tensors.items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            local = local.detach()
            buf = self._buffer_for(key, local)
            non_blocking = self.pin_memory and local.device.type == "cuda"
            buf.copy_(local, non_blocking=non_blocking)
            needs_sync = needs_sync or non_blocking
            total += buf.numel() * buf.element_size()
            staged[key] = _like(tensor, buf)
        if needs_sync:
            torch.cuda.synchronize()
        for stale in set(self._buffers) - set(tensors) - set(keep):
            del self._buffers[stale]
        self.last_staged_bytes = total
        return staged

    def stage_deferred(
        self, tensors: dict[str, torch.Tensor], deferred: Collection[str]
    ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`stage` for the keys not in ``deferred``; for those only their buffers, and
        the ``(buffer, source)`` pairs left to copy (save/overlap.py copies them later)."""
        later = {k: t for k, t in tensors.items() if k in deferred}
        staged = self.stage({k: t for k, t in tensors.items() if k not in later}, keep=later)
        pairs = []
        for key, tensor in later.items():
            source = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            buf = self._buffer_for(key, source.detach())
            pairs.append((buf, source.detach()))
            staged[key] = _like(tensor, buf)
            self.last_staged_bytes += buf.numel() * buf.element_size()
        return {k: staged[k] for k in tensors}, pairs

    def _buffer_for(self, key: str, local: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[key] = buf
            self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def release(self) -> None:
        """Drop every buffer (the next save allocates again)."""
        self._wait_prepared()
        self._buffers.clear()


def _spec(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.shape, local.dtype


def _like(original: torch.Tensor, host: torch.Tensor) -> Any:
    if isinstance(original, DTensor):
        return DTensor.from_local(
            host,
            original.device_mesh,
            original.placements,
            run_check=False,
            shape=original.shape,
            stride=original.stride(),
        )
    return host
