"""The host-memory budget of staging: which tensors get host buffers, which are streamed
(docs/host-memory.md: why, the options, what happens over the budget). A share that fits is
staged whole; one that does not keeps as many tensors as fit (smallest first) and streams the
rest from the training state, and the save blocks until they are written."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_preempt.errors import CheckpointWriteError
from lightning_preempt.staging.stager import HostStager, host_cost, local_of, nbytes

log = logging.getLogger(__name__)

#: Share of ``MemAvailable`` (per local rank) the default budget takes: the rest is left to
#: data loaders, the page cache the writer fills, and everything else on the node.
DEFAULT_FRACTION = 0.5
#: Below this a budget is surely a mistake (a fraction meant as bytes, e.g. ``budget=1``).
MIN_BUDGET_BYTES = 1 << 20
HINT = (
    "host_memory_budget is bytes (an int, e.g. 32 * 2**30) or a fraction of the available memory "
    f"(a float in (0, 1], e.g. 0.5); None takes {DEFAULT_FRACTION:.0%} of MemAvailable divided by the ranks of this node."
)


def check_budget(name: str, value: Any) -> int | float | None:
    """``None``, an int of bytes >= :data:`MIN_BUDGET_BYTES`, or a float fraction in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be bytes (int), a fraction (float) or None, got {value!r}\nHINT: {HINT}")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{name} as a fraction must be in (0, 1], got {value!r}\nHINT: {HINT}")
        return value
    if value < MIN_BUDGET_BYTES:
        raise ValueError(f"{name} must be at least {MIN_BUDGET_BYTES} bytes (1 MiB), got {value!r}\nHINT: {HINT}")
    return int(value)


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, or ``None`` where the kernel does not say (not Linux)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def local_ranks() -> int:
    """The processes of this job on this node: torchrun's ``LOCAL_WORLD_SIZE``, SLURM's
    ``SLURM_NTASKS_PER_NODE``; else one per visible GPU (Lightning's own launcher sets
    neither; one rank per GPU is the usual layout); else 1."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(os.environ.get(var, "").split("(")[0]))
        except ValueError:
            continue
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


@dataclasses.dataclass(frozen=True)
class Budget:
    """A resolved budget in bytes (``None``: unlimited, the memory size is unknown)."""

    host_bytes: int | None
    pinned_bytes: int | None


def resolve(host: int | float | None, pinned: int | float | None, *, held_bytes: int = 0,
            available: int | None = None) -> Budget:  # fmt: skip
    """Bytes from the options; fractions and the default read ``available`` (``MemAvailable``
    plus the ``held_bytes`` of buffers this process already holds)."""
    avail = mem_available() if available is None else available
    base = None if avail is None else avail + held_bytes

    def of(value: int | float | None) -> int | None:
        if isinstance(value, int):
            return value
        if base is None:
            return None
        return int(base * value) if value is not None else int(base * DEFAULT_FRACTION / local_ranks())

    host_bytes = of(host)
    pinned_bytes = host_bytes if pinned is None else of(pinned)
    if host_bytes is not None and pinned_bytes is not None:
        pinned_bytes = min(pinned_bytes, host_bytes)
    return Budget(host_bytes, pinned_bytes)


@dataclasses.dataclass
class Split:
    """One save's plan: ``resident`` keys get buffers (``pinned`` ones pinned); ``streamed``
    keys are written from the live tensors, device ones through a ``chunk_bytes`` host chunk."""

    resident: list[str]
    pinned: set[str]
    streamed: list[str]
    chunk_bytes: int
    total_bytes: int
    resident_bytes: int
    chunk_pinned: bool = False

    @property
    def streamed_bytes(self) -> int:
        return self.total_bytes - self.resident_bytes


def split(tensors: dict[str, torch.Tensor], budget: Budget, *, pin: bool) -> Split:
    """Resident tensors smallest first while they and the chunk fit (see the module docstring)."""
    if not pin and all(type(t) is torch.Tensor for t in tensors.values()):
        # The common CPU case in one C-level pass (thousands of tensors, while training waits).
        total = sum(map(operator.attrgetter("nbytes"), tensors.values()))
        if budget.host_bytes is None or total <= budget.host_bytes:
            return Split(list(tensors), set(), [], 0, total, total)
    sizes = {key: t.nbytes if type(t) is torch.Tensor else nbytes(t) for key, t in tensors.items()}
    total = sum(sizes.values())
    # what each buffer costs the host (pinned ones are rounded up); conservative: as if pinned
    costs = {key: host_cost(size, True) for key, size in sizes.items()} if pin else sizes
    limit = budget.host_bytes
    if limit is None or sum(costs.values()) <= limit:
        keys = list(tensors)
        return Split(keys, _pinned(keys, costs, budget, pin), [], 0, total, total)
    on_device = [key for key, t in tensors.items() if local_of(t).device.type != "cpu"]
    # The chunk holds the largest streamed device tensor; reserved first, as any of the
    # largest ones may end up streamed. A tensor larger than the whole budget still needs it.
    chunk = max((costs[k] for k in on_device), default=0)
    resident: list[str] = []
    used = 0
    for key in sorted(tensors, key=lambda k: sizes[k]):
        if used + costs[key] + chunk > limit:
            break
        resident.append(key)
        used += costs[key]
    chosen = set(resident)
    streamed = [key for key in tensors if key not in chosen]
    chunk = max((sizes[k] for k in streamed if k in on_device), default=0)
    ordered = [key for key in tensors if key in chosen]
    pinned = _pinned(ordered, costs, budget, pin)
    room = None if budget.pinned_bytes is None else budget.pinned_bytes - sum(costs[k] for k in pinned)
    chunk_pinned = pin and chunk > 0 and (room is None or host_cost(chunk, True) <= room)
    return Split(ordered, pinned, streamed, chunk, total, sum(sizes[k] for k in ordered), chunk_pinned)


def _pinned(keys: list[str], costs: dict[str, int], budget: Budget, pin: bool) -> set[str]:
    if not pin:
        return set()
    cap = budget.pinned_bytes
    out: set[str] = set()
    used = 0
    for key in keys:
        if cap is None or used + costs[key] <= cap:
            out.add(key)
            used += costs[key]
    return out


class Streamed:
    """The tensors of one save that the writer reads from the training state. The save blocks
    in :meth:`wait` until the writer :meth:`release` s them; after that training changes them,
    so a second write attempt (the two-tier fallback) fails in :meth:`check` instead of
    committing a mix of two steps."""

    def __init__(self, keys: list[str], chunk: ChunkBuffer | None) -> None:
        self.keys = frozenset(keys)
        self._chunk = chunk
        self._event = threading.Event()
        self._released = False

    def check(self) -> None:
        """Raise when the live tensors may already have changed (see the class docstring)."""
        if self._released:
            raise CheckpointWriteError(
                "part of this checkpoint was streamed from the training state (it exceeded "
                "host_memory_budget) and training has moved on: it cannot be written a second time",
                hint="Raise host_memory_budget so the whole share is staged, or fix the first tier's storage; "
                "earlier committed checkpoints are intact.",
            )

    def release(self) -> None:
        """Writer: every streamed tensor is written (also called when the write job ends)."""
        self._event.set()

    def wait(self) -> None:
        """Training thread: block until :meth:`release`; from then on :meth:`check` fails."""
        self._event.wait()
        self._released = True

    @contextmanager
    def on_host(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """``tensor`` as a host tensor valid inside the block (a device one in the chunk)."""
        if tensor.device.type == "cpu" or self._chunk is None:
            yield tensor.detach()
            return
        with self._chunk.holding(tensor) as host:
            yield host


class ChunkBuffer:
    """One reusable host buffer that device tensors pass through, one at a time; allocated
    on first use (after the stager freed what this save no longer stages)."""

    def __init__(self, nbytes: int, pin: bool, account: Callable[[int], None]) -> None:
        self.nbytes = nbytes
        self.pinned = pin
        self._account = account
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()  # writer threads (thread_count > 1) take turns

    def free(self) -> None:
        with self._lock:
            if self._buffer is not None:
                self._buffer = None
                self._account(-host_cost(self.nbytes, self.pinned))

    @contextmanager
    def holding(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        with self._lock:
            if self._buffer is None:
                self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
                self._account(host_cost(self.nbytes, self.pinned))
            host = self._buffer[: tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            host.copy_(tensor.detach(), non_blocking=self.pinned)
            if self.pinned:
                torch.cuda.current_stream(tensor.device).synchronize()
            yield host


class StagingBudget:
    """The budget of one saver: resolves the options once per process, splits each save,
    owns the chunk, and warns once when a save had to stream (see the module docstring)."""

    def __init__(self, host_memory_budget: int | float | None = None,
                 pinned_memory_budget: int | float | None = None) -> None:  # fmt: skip
        self.host_option = check_budget("host_memory_budget", host_memory_budget)
        self.pinned_option = check_budget("pinned_memory_budget", pinned_memory_budget)
        self.budget: Budget | None = None
        self.last_split: Split | None = None
        self._staged_whole: Split | None = None  # the last split, if the stager staged all of it
        self._chunk: ChunkBuffer | None = None
        self._warned = False

    def split(self, tensors: dict[str, torch.Tensor], stager: HostStager, *, unchanged: bool = False) -> Split:
        """Which of ``tensors`` ``stager`` stages; frees the chunk when none is needed.
        ``unchanged``: ``stager.unchanged(tensors, key)`` (the save's structure key); when they
        are the set last staged whole (:meth:`staged`), that split again, without a pass over
        thousands of tensors."""
        last = self.last_split
        if unchanged and last is not None and last is self._staged_whole:
            return last
        if self.budget is None:
            self.budget = resolve(self.host_option, self.pinned_option, held_bytes=stager.held_bytes)
        self.last_split = plan = split(tensors, self.budget, pin=stager.pin_memory)
        self._staged_whole = None
        chunk = self._chunk
        if chunk is not None and (chunk.nbytes < plan.chunk_bytes or plan.chunk_bytes == 0):
            chunk.free()
            self._chunk = None
        return plan

    def staged(self, plan: Split) -> None:
        """The stager has just staged ``plan`` (the save's own stage, not a preallocation)."""
        self._staged_whole = plan if plan is self.last_split and not plan.streamed else None

    def streamed(self, plan: Split, stager: HostStager) -> Streamed | None:
        """The writer's view of ``plan``'s streamed tensors (``None``: everything is staged)."""
        if not plan.streamed:
            return None
        if plan.chunk_bytes and self._chunk is None:
            self._chunk = ChunkBuffer(plan.chunk_bytes, plan.chunk_pinned, stager.account)
        return Streamed(plan.streamed, self._chunk)

    def warn_once(self, plan: Split, blocked_s: float, staged_s: float) -> None:
        """One warning per process: how much was streamed, what it cost (``blocked_s``, against
        ``staged_s`` scaled from the staged part to the whole share), what to do."""
        if self._warned or not plan.streamed:
            return
        self._warned = True
        budget = self.budget.host_bytes if self.budget is not None else None
        chunk = ""
        if plan.chunk_bytes:
            chunk = f" (device tensors through a {plan.chunk_bytes / 2**20:.1f} MiB host chunk"
            past = plan.resident_bytes + host_cost(plan.chunk_bytes, plan.chunk_pinned) > (budget or 0)
            chunk += ", which alone exceeds the budget: the largest tensor is larger)" if past else ")"
        fit_s = staged_s * plan.total_bytes / max(plan.resident_bytes, 1) if plan.resident_bytes else None
        instead = f"{fit_s:.3f}s" if fit_s is not None else "the copy alone"
        log.warning(
            "lightning_preempt: this rank's share of the checkpoint (%.1f MiB) exceeds host_memory_budget "
            "(%.1f MiB): %.1f MiB were staged and %.1f MiB written straight from the training state%s, so the "
            "save blocked training %.3fs instead of about %s, until those were written (a save that fits returns "
            "after the copy). "
            "The budget keeps staging from running the host out of memory.\nHINT: raise host_memory_budget "
            "(and pinned_memory_budget) if the node has the memory, or save fewer bytes per rank (shard "
            "the state over more ranks).",
            plan.total_bytes / 2**20, (budget or 0) / 2**20, plan.resident_bytes / 2**20, plan.streamed_bytes / 2**20,
            chunk, blocked_s, instead,
        )  # fmt: skip
