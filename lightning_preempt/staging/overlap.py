"""Overlapped staging: a save returns before its large copies finish; the next step's
forward and backward run while they do (docs/staging.md: the rules, why the snapshot is
exactly step k's). Deferred are the large tensors only an optimizer step changes
(:attr:`Overlap.stable`); :meth:`Overlap.settle` is what their first change waits for."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_preempt.errors import CheckpointWriteError
from lightning_preempt.format.structure import Structure
from lightning_preempt.staging.stager import copy_all, local_of

if TYPE_CHECKING:
    from lightning_preempt.staging.stager import HostStager

log = logging.getLogger(__name__)

#: Tensors smaller than this are copied before ``save`` returns: their copy costs less than
#: keeping track of it, and small tensors (step counters, tensor learning rates) are the
#: ones code outside the optimizer step tends to change.
MIN_DEFERRED_BYTES = 64 * 1024

#: ``overlap_staging=None`` turns overlap on with CUDA. Off until scripts/gpu_check.sh has
#: shown the stream path on a GPU (docs/staging.md); on CPU it is off because the copy
#: competes with the step for the same cores and memory bandwidth (docs/benchmark-results.md).
AUTO_ON_CUDA = False

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (host buffer, source)


def resolve(option: bool | None) -> bool:
    """``overlap_staging`` as configured: ``None`` is on with CUDA when :data:`AUTO_ON_CUDA`."""
    return bool(option) if option is not None else AUTO_ON_CUDA and torch.cuda.is_available()


def _storage(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), local_of(tensor).untyped_storage().data_ptr()


def copy_on_thread(pairs: Pairs) -> None:
    """The helper thread's copies (a module function: a test holds it to widen the window),
    in one call that releases the GIL (training runs meanwhile)."""
    copy_all([buf for buf, _ in pairs], [src for _, src in pairs])


class InFlightCopy:
    """The deferred copies of one save: a helper thread's Future and/or CUDA events."""

    def __init__(self, pairs: Pairs, streams: dict[torch.device, Any]) -> None:
        self.bytes = sum(b.numel() * b.element_size() for b, _ in pairs)
        host = [(b, s) for b, s in pairs if s.device.type != "cuda"]
        self._events: list[tuple[torch.device, Any]] = []
        for device in {s.device for _, s in pairs if s.device.type == "cuda"}:
            stream = streams.setdefault(device, torch.cuda.Stream(device))
            stream.wait_stream(torch.cuda.current_stream(device))  # copy step k's values, not earlier ones
            with torch.cuda.stream(stream):
                for buf, src in pairs:
                    if src.device == device:
                        buf.copy_(src, non_blocking=True)
                        src.record_stream(stream)  # a replaced state tensor's memory is not reused under the copy
            event = torch.cuda.Event()
            event.record(stream)
            self._events.append((device, event))
        self._thread: Future[None] = Future()
        if not host:
            self._thread.set_result(None)
            return
        versions = [s._version for _, s in host]

        def run() -> None:
            try:
                copy_on_thread(host)
                if [s._version for _, s in host] != versions:
                    raise CheckpointWriteError(
                        "a tensor changed in place while its overlapped copy ran; this save is not committed",
                        hint="Only an optimizer step may change parameters or optimizer state between a save and "
                        "the next step (docs/staging.md); call saver.settle() first, or pass overlap_staging=False.",
                    )
                self._thread.set_result(None)
            except BaseException as err:
                self._thread.set_exception(err)

        threading.Thread(target=run, name="lightning_preempt-overlap", daemon=True).start()

    def gate(self) -> None:
        """Order what comes next after the copies: the device waits for the events (the host
        does not), the host waits for the thread. Errors stay for :meth:`wait` (the writer)."""
        for device, event in self._events:
            torch.cuda.current_stream(device).wait_event(event)
        with contextlib.suppress(BaseException):
            self._thread.result()

    def wait(self) -> None:
        """The writer: block until every buffer is filled; raises the thread's error."""
        for _, event in self._events:
            event.synchronize()
        self._thread.result()


class Overlap:
    """Which tensors a save may copy late, the copy in flight, and the gate before mutations.

    Args:
        enabled: overlap at all (``overlap_staging``, resolved by :func:`resolve`).
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        #: Returns the tensors only an optimizer step changes (set by the front-end);
        #: ``None``: nothing is deferred.
        self.stable: Callable[[], Iterable[torch.Tensor]] | None = None
        self._inflight: InFlightCopy | None = None
        self._streams: dict[torch.device, Any] = {}
        self._hook: Any = None

    @property
    def in_flight(self) -> bool:
        """Whether deferred copies were started and not yet waited for at a gate."""
        return self._inflight is not None

    def stage(self, stager: HostStager, tensors: dict[str, torch.Tensor], pinned: set[str], *,
              defer: bool = True, key: Structure | None = None) -> tuple[dict[str, torch.Tensor], InFlightCopy | None]:  # fmt: skip
        """``stager.stage(tensors)``, but the deferrable ones (``defer``) only get their
        buffers and are copied by the returned :class:`InFlightCopy` (``None``: none was).
        ``key``: the save's structure key (format/structure.py)."""
        keys = self.deferrable(tensors, pinned) if defer else set()
        if not keys:
            return stager.stage(tensors, pinned=pinned, key=key), None
        staged, pairs = stager.stage_deferred(tensors, keys, pinned=pinned, key=key)
        return staged, self.start(pairs)

    def deferrable(self, tensors: dict[str, torch.Tensor], pinned: Collection[str]) -> set[str]:
        """The keys of ``tensors`` whose copy may run after ``save`` returns (the module
        docstring); CUDA tensors only into ``pinned`` buffers (a pageable copy blocks anyway)."""
        if not self.enabled or self.stable is None:
            return set()
        stable = {_storage(t) for t in self.stable() if isinstance(t, torch.Tensor) and t.numel()}
        local = ((key, local_of(tensor)) for key, tensor in tensors.items())
        return {
            key
            for key, t in local
            if t.numel() * t.element_size() >= MIN_DEFERRED_BYTES
            and (t.device.type == "cpu" or (t.device.type == "cuda" and key in pinned))
            and t.is_contiguous()
            and _storage(t) in stable
        }

    def start(self, pairs: Pairs) -> InFlightCopy:
        """Start the deferred copies of one save; the gate waits for them from now on."""
        self.settle()
        copy = InFlightCopy(pairs, self._streams)
        self._inflight = copy
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(_gate_hook(weakref.ref(self)))
        return copy

    def settle(self) -> None:
        """The gate: what comes next is ordered after the copy in flight (a no-op without one)."""
        copy, self._inflight = self._inflight, None
        if copy is not None:
            copy.gate()

    def close(self) -> None:
        """Settle, and remove the optimizer hook (not from inside an optimizer step)."""
        self.settle()
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()


def _gate_hook(ref: weakref.ref[Overlap]) -> Callable[..., Any]:
    """A global optimizer step pre-hook that settles ``ref``'s copy before the update."""

    def hook(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        overlap = ref()
        if overlap is None or overlap._inflight is None:
            return None
        positional = kwargs.get("closure") is None and len(args) > 1
        closure = args[1] if positional else kwargs.get("closure")
        if closure is None:
            overlap.settle()
            return None

        def settled_closure() -> Any:
            # Forward and backward run inside the closure (Lightning's automatic
            # optimization): they overlap too, and the update waits after them.
            result = closure()
            overlap.settle()
            return result

        if positional:  # passed back the way it came: not every optimizer names it "closure"
            return ((args[0], settled_closure, *args[2:]), kwargs)
        return (args, {**kwargs, "closure": settled_closure})

    return hook
