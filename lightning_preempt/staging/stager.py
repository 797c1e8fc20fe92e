"""Staging: copy device tensors into reusable host buffers. No I/O here.

Buffers are reused by every later save of the same shapes (a steady-state save allocates
nothing), so a save stages only once the previous one's tensors are written (the writer reads
the buffers until then; its commit may go on: two saves in flight, no more). They
are pinned when CUDA is present; :meth:`HostStager.prepare` allocates and touches them ahead of
time, on a thread (first touch and pinning cost several times the copy; the first save may be
the emergency one). Which tensors get a buffer is the budget's decision (``staging/budget.py``)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_preempt.format.structure import Structure

log = logging.getLogger(__name__)


class HostStager:
    """Copies ``{key: tensor}`` into host buffers that it owns and reuses.

    ``stage`` returns a dict of host tensors (``DTensor`` stays ``DTensor`` with a host
    local shard) that stays valid until the next ``stage`` call.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()  # keys whose buffer is pinned (is_pinned() costs ~50 us)
        self.allocated_bytes = 0
        self.last_staged_bytes = 0
        #: host bytes held now / at most (buffers plus what :meth:`account` was told)
        self.held_bytes = 0
        self.peak_bytes = 0
        self._announced = False
        self._prep: Future[int] | None = None
        #: the last stage()'s routing, reused while nothing about the tensors or buffers changed
        self._plan: _StagePlan | None = None
        #: called when a buffer is dropped, before any new one is allocated: whoever keeps
        #: views of the buffers (the writer's replayed layout) lets go of them, so an old and
        #: a new buffer are never held at once
        self.on_release: Callable[[], None] | None = None

    def account(self, delta: int) -> None:
        """Count ``delta`` more (or fewer) bytes of staging memory held (the budget's chunk)."""
        self.held_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def prepare(self, tensors: dict[str, torch.Tensor], *, background: bool = True,
                pinned: set[str] | None = None) -> Future[int]:  # fmt: skip
        """Allocate and touch the buffers ``stage(tensors)`` will use (from shapes and dtypes
        only), so that it only copies; buffers are kept, replaced or freed as :meth:`stage`
        would. With ``background`` a daemon thread does the work (allocation and the memset
        release the GIL) and a ``stage`` meanwhile waits for it. The Future holds the bytes
        newly allocated. ``pinned``: the keys to pin (default: all when :attr:`pin_memory`)."""
        specs = {key: (local_of(t).shape, local_of(t).dtype) for key, t in tensors.items()}
        self._wait_prepared()
        fut: Future[int] = Future()
        if not background:
            fut.set_result(self._allocate(specs, pinned))
            return fut
        self._prep = fut

        def run() -> None:
            try:
                fut.set_result(self._allocate(specs, pinned))
            except BaseException as err:  # e.g. out of (pinned) memory: stage() allocates itself
                fut.set_exception(err)

        threading.Thread(target=run, name="lightning_preempt-prealloc", daemon=True).start()
        return fut

    def _allocate(self, specs: dict[str, tuple[torch.Size, torch.dtype]], pinned: set[str] | None) -> int:
        added = 0
        for stale in set(self._buffers) - set(specs):  # as stage() would: never old and new at once
            self._drop(stale)
        for key, (shape, dtype) in specs.items():
            old = self._buffers.get(key)
            buf = self._buffer_for(key, shape, dtype, self._pins(key, pinned))
            if buf is not old:
                buf.zero_()  # touch every page now, not inside the first (emergency) save
                added += nbytes(buf)
        return added

    def _pins(self, key: str, pinned: set[str] | None) -> bool:
        return self.pin_memory and (pinned is None or key in pinned)

    def _drop(self, key: str) -> None:
        buf = self._buffers.pop(key, None)
        self._plan = None
        if buf is not None and self.on_release is not None:
            self.on_release()
        pinned = key in self._pinned
        self._pinned.discard(key)
        if buf is not None:
            self.account(-host_cost(nbytes(buf), pinned))

    def _wait_prepared(self) -> None:
        prep, self._prep = self._prep, None
        if prep is not None and (err := prep.exception()) is not None:
            log.warning("lightning_preempt: preallocating staging buffers failed (%s); the save allocates them", err)

    def unchanged(self, tensors: dict[str, torch.Tensor], key: Structure | None) -> bool:
        """Whether ``tensors`` are the set :meth:`stage` staged last, with the structure key
        (format/structure.py) it was staged with, and every buffer is still there. Then ``stage``
        only copies, and a caller may reuse what it decided for that set (the budget's split)."""
        self._wait_prepared()  # (a preallocation may replace buffers: the plan is then gone)
        plan = self._plan
        return plan is not None and key is not None and plan.key is key and list(tensors) == plan.keys

    def stage(self, tensors: dict[str, torch.Tensor], pinned: set[str] | None = None, *,
              keep: Collection[str] = (), key: Structure | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        """Copy ``tensors`` into buffers (``pinned``: the keys to pin; default all when
        :attr:`pin_memory`). Buffers of other keys (except ``keep``) are freed first, so a
        smaller budget never holds old and new buffers at once. ``key``: the save's structure
        key (format/structure.py): while it is the last one, the last routing is reused."""
        unchanged = self.unchanged(tensors, key)
        self._wait_prepared()
        plan = self._plan
        if unchanged and plan is not None and plan.routes(pinned, keep):
            # The same tensors as last time (keys, types, shapes, dtypes, devices), the same
            # buffers: only the copies. Thousands of tensors then cost well under 1 ms of
            # checks (C-level passes), not ~6 ms per-tensor Python, while training waits.
            values = list(tensors.values())
            copy_all(plan.buffers, values if not plan.async_ else [values[i] for i in plan.sync])
            copy_all(plan.async_buffers, [values[i] for i in plan.async_], non_blocking=True)
            if plan.async_:
                torch.cuda.synchronize()
            self.last_staged_bytes = plan.total
            return dict(plan.staged)
        for stale in set(self._buffers) - set(tensors) - set(keep):
            self._drop(stale)
        if not self._announced:
            kind = "pinned host memory" if self.pin_memory else "plain host memory (no CUDA: pinning unavailable)"
            log.info("lightning_preempt: staging checkpoints in reusable %s", kind)
            self._announced = True
        staged: dict[str, torch.Tensor] = {}
        bufs: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        async_bufs: list[torch.Tensor] = []  # pinned, from a device
        async_sources: list[torch.Tensor] = []
        routed: list[int] = []  # the indices of the async ones
        total = 0
        buffers, pinned_keys, pin_any = self._buffers, self._pinned, self.pin_memory
        for i, (name, tensor) in enumerate(tensors.items()):  # (per tensor: thousands of them while training waits)
            local = tensor if type(tensor) is torch.Tensor else local_of(tensor)
            pin = pin_any and (pinned is None or name in pinned)
            buf = buffers.get(name)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype or (name in pinned_keys) != pin:
                buf = self._buffer_for(name, local.shape, local.dtype, pin)
            if pin and local.device.type == "cuda":
                async_bufs.append(buf)
                async_sources.append(local)
                routed.append(i)
            else:
                bufs.append(buf)
                sources.append(local)
            total += buf.nbytes
            staged[name] = buf if local is tensor else _like(tensor, buf)
        copy_all(bufs, sources)
        copy_all(async_bufs, async_sources, non_blocking=True)
        if async_bufs:
            torch.cuda.synchronize()
        self.last_staged_bytes = total
        values = list(tensors.values())
        if all(type(v) is torch.Tensor for v in values):  # (DTensors: their shards are looked up each time)
            is_async = set(routed)
            self._plan = _StagePlan(
                key=key,
                keys=list(tensors),
                pinned=None if pinned is None else frozenset(pinned),
                keep=frozenset(keep),
                staged=dict(staged),
                buffers=bufs,
                sync=[i for i in range(len(values)) if i not in is_async] if routed else [],
                async_buffers=async_bufs,
                async_=routed,
                total=total,
            )
        return staged

    def stage_deferred(
        self, tensors: dict[str, torch.Tensor], deferred: Collection[str], pinned: set[str] | None = None,
        key: Structure | None = None
    ) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`stage` (with ``key``) for the keys not in ``deferred``; for those only their
        buffers, and the ``(buffer, source)`` pairs left to copy (staging/overlap.py copies them later)."""
        later = {k: t for k, t in tensors.items() if k in deferred}
        staged = self.stage({k: t for k, t in tensors.items() if k not in later}, pinned, keep=later, key=key)
        pairs = []
        for name, tensor in later.items():
            source = local_of(tensor).detach()
            buf = self._buffer_for(name, source.shape, source.dtype, self._pins(name, pinned))
            pairs.append((buf, source))
            staged[name] = _like(tensor, buf)
            self.last_staged_bytes += nbytes(buf)
        return {k: staged[k] for k in tensors}, pairs

    def _buffer_for(self, key: str, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype or (key in self._pinned) != pin:
            self._drop(key)  # before allocating: never the old and the new buffer at once
            buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
            if pin:
                self._pinned.add(key)
            self._buffers[key] = buf
            self._plan = None
            self.allocated_bytes += nbytes(buf)
            self.account(host_cost(nbytes(buf), pin))
        return buf


@dataclasses.dataclass(frozen=True)
class _StagePlan:
    """How the last :meth:`HostStager.stage` routed each tensor (plain tensors only)."""

    key: Structure | None  # the structure key of the save staged
    keys: list[str]
    pinned: frozenset[str] | None
    keep: frozenset[str]
    staged: dict[str, torch.Tensor]  # what stage() returned (the buffers), copied per call
    buffers: list[torch.Tensor]  # copied into synchronously, sources at ``sync``
    sync: list[int]
    async_buffers: list[torch.Tensor]  # pinned, from a device, sources at ``async_``
    async_: list[int]
    total: int

    def routes(self, pinned: set[str] | None, keep: Collection[str]) -> bool:
        """Whether this routing applies to the same tensors staged with ``pinned`` and ``keep``."""
        return self.pinned == (None if pinned is None else frozenset(pinned)) and self.keep == frozenset(keep)


def copy_all(buffers: list[torch.Tensor], sources: list[torch.Tensor], *, non_blocking: bool = False) -> None:
    """``buffer.copy_(source)`` for every pair, in one call: thousands of small tensors
    then cost one dispatch, not one Python call each (torch's ``_foreach_copy_``)."""
    if buffers:
        with torch.no_grad():  # (the sources may need grad; the buffers never do)
            torch._foreach_copy_(buffers, sources, non_blocking=non_blocking)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def host_cost(nbytes: int, pinned: bool) -> int:
    """Host bytes a buffer of ``nbytes`` takes: torch's pinned (caching host) allocator rounds
    every block up to a power of two, and the budget counts what the host gives up."""
    return 1 << max(nbytes - 1, 0).bit_length() if pinned and nbytes > 0 else nbytes


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s local data (a DTensor's own shard)."""
    return local_of(tensor).nbytes


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
