"""Rank agreement helpers. Collectives that report errors instead of hanging, and the
overlapped flag exchange at step boundaries (:class:`FlagAgreement`).

Every helper takes an explicit process group so the background writer can use its own
gloo group and never touch the training group (mixing threads on one group deadlocks).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_preempt.errors import CheckpointError

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


#: An object collective's one message a rank: the pickle's length (8 bytes), then up to this
#: many of its bytes; a longer pickle's rest follows in a second message (every rank sees the
#: lengths, so every rank takes the same branch). torch's object collectives send the size and
#: the bytes apart: two messages, for the few hundred bytes our decisions and entries take.
OBJECT_BLOCK_BYTES = 4096
_HEADER = 8


def _block(data: bytes) -> bytearray:
    block = bytearray(OBJECT_BLOCK_BYTES)
    block[:_HEADER] = len(data).to_bytes(_HEADER, "little")
    head = data[: OBJECT_BLOCK_BYTES - _HEADER]
    block[_HEADER : _HEADER + len(head)] = head
    return block


def _length(block: bytearray | bytes) -> int:
    return int.from_bytes(block[:_HEADER], "little")


def _gloo(group: ProcessGroup) -> bool:
    """CPU messages suit the group (ours are gloo; another backend gets torch's collectives)."""
    return bool(dist.get_backend(group) == "gloo")


def _uint8(buffer: bytearray) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)


def all_gather_objects(obj: Any, group: ProcessGroup | None) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, …]`` on every rank (``[obj]`` without a group);
    pickled, as torch's ``all_gather_object``: only for values this job made itself."""
    if group is None or not is_distributed():
        return [obj]
    if not _gloo(group):
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
    data = pickle.dumps(obj)
    world = dist.get_world_size(group)
    blocks = [bytearray(OBJECT_BLOCK_BYTES) for _ in range(world)]
    dist.all_gather([_uint8(b) for b in blocks], _uint8(_block(data)), group=group)
    lengths = [_length(b) for b in blocks]
    room = OBJECT_BLOCK_BYTES - _HEADER
    rest = max(n - room for n in lengths)
    tails = [b""] * world
    if rest > 0:  # a long pickle somewhere: the rests, padded to the longest (gloo: equal sizes)
        mine = bytearray(rest)
        mine[: max(0, len(data) - room)] = data[room:]
        got = [bytearray(rest) for _ in range(world)]
        dist.all_gather([_uint8(b) for b in got], _uint8(mine), group=group)
        tails = [bytes(b[: max(0, n - room)]) for b, n in zip(got, lengths, strict=True)]
    return [
        pickle.loads(bytes(b[_HEADER : _HEADER + min(n, room)]) + tail)
        for b, n, tail in zip(blocks, lengths, tails, strict=True)
    ]


def start_gather_digests(digest: bytes, group: ProcessGroup | None) -> Callable[[], list[bytes]]:
    """Start gathering every rank's ``digest`` (the same length on every rank) over ``group``
    (a gloo group of :func:`new_gloo_group`'s: the saver's stage group) and return the wait for
    them, ``[rank 0's, rank 1's, …]``: the gather runs on gloo's thread while the caller works
    (a save copies meanwhile). Every rank must call it, in the same order as the group's other
    collectives."""
    if group is None or not is_distributed():
        return lambda: [digest]
    mine = _uint8(bytearray(digest))
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(out, mine, group=group, async_op=True)

    def wait() -> list[bytes]:
        if work is not None:
            work.wait()
        return [t.numpy().tobytes() for t in out]

    return wait


def broadcast_object(obj: Any, group: ProcessGroup | None) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (pickled: only for values this job made
    itself; what was read from storage goes by :func:`broadcast_json`)."""
    if group is None or not is_distributed():
        return obj
    src = dist.get_global_rank(group, 0)
    if not _gloo(group):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]
    sender = dist.get_rank(group) == 0
    data = pickle.dumps(obj) if sender else b""
    block = _block(data) if sender else bytearray(OBJECT_BLOCK_BYTES)
    dist.broadcast(_uint8(block), src=src, group=group)
    n = _length(block)
    room = OBJECT_BLOCK_BYTES - _HEADER
    rest = bytearray(data[room:]) if sender else bytearray(max(0, n - room))
    if n > room:
        dist.broadcast(_uint8(rest), src=src, group=group)
    if sender:
        return obj
    return pickle.loads(bytes(block[_HEADER : _HEADER + min(n, room)]) + bytes(rest))


class WireError(CheckpointError):
    """Bytes sent over a collective were more than allowed, or not the JSON expected; a size
    is raised alike on every rank (the length travels first, every rank sees it)."""


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _decode(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise WireError(f"a value received from another rank is not valid JSON ({err})",
                        hint="Ranks of one job run one build of lightning_preempt; check that they do.") from None  # fmt: skip


def _too_large(size: int, max_bytes: int, rank: int) -> WireError:
    return WireError(
        f"rank {rank} sent {size} bytes, more than the {max_bytes} allowed",
        hint="The value came from storage and is larger than any checkpoint of this package writes; inspect it.",
    )


def broadcast_bytes(data: bytes | None, group: ProcessGroup | None, *, max_bytes: int) -> bytes:
    """Rank 0's ``data`` on every rank of ``group``: its length (one int64) first, checked
    against ``max_bytes`` on every rank before a buffer is allocated, then the bytes as a
    uint8 tensor. Nothing is unpickled. Collective: every rank calls it (``data`` is read on
    rank 0 only). Raises :class:`WireError` on every rank alike."""
    if group is None or not is_distributed():
        out = bytes(data or b"")
        if len(out) > max_bytes:
            raise _too_large(len(out), max_bytes, 0)
        return out
    src = dist.get_global_rank(group, 0)
    sender = dist.get_rank(group) == 0
    payload = bytes(data or b"") if sender else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    if not 0 <= n <= max_bytes:
        raise _too_large(n, max_bytes, 0)
    if n == 0:
        return b""
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if sender else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return payload if sender else buf.numpy().tobytes()


def all_gather_bytes(data: bytes, group: ProcessGroup | None, *, max_bytes: int) -> list[bytes]:
    """``[data of rank 0, data of rank 1, …]`` on every rank (see :func:`broadcast_bytes`;
    ``max_bytes`` bounds each rank's share, checked on every rank before allocating)."""
    if group is None or not is_distributed():
        return [broadcast_bytes(data, None, max_bytes=max_bytes)]
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    lengths = [int(s.item()) for s in sizes]
    for r, n in enumerate(lengths):
        if not 0 <= n <= max_bytes:
            raise _too_large(n, max_bytes, r)
    width = max(max(lengths), 1)  # gloo's all_gather wants equal sizes: pad to the longest
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    return [b.numpy().tobytes()[:n] for b, n in zip(bufs, lengths, strict=True)]


def broadcast_json(obj: Any, group: ProcessGroup | None, *, max_bytes: int) -> Any:
    """Rank 0's ``obj`` (JSON-serialisable) on every rank, as UTF-8 JSON bytes
    (:func:`broadcast_bytes`), never pickled: what came from storage cannot run code on a
    receiver. Tuples arrive as lists. Collective."""
    sender = group is None or not is_distributed() or dist.get_rank(group) == 0
    return _decode(broadcast_bytes(_encode(obj) if sender else None, group, max_bytes=max_bytes))


def all_gather_json(obj: Any, group: ProcessGroup | None, *, max_bytes: int) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, …]`` on every rank, as JSON bytes
    (:func:`all_gather_bytes`), never pickled. Collective."""
    return [_decode(b) for b in all_gather_bytes(_encode(obj), group, max_bytes=max_bytes)]


class FlagAgreement:
    """All ranks learn, at the same step boundary, whether any rank raised a flag: a MAX
    all-reduce of a small int tensor on a gloo group. Overlapped (:meth:`launch`, then
    :meth:`flush` at a later boundary), the reduction runs while the next step computes;
    every rank reads the same result at the same boundary, and a pending result is OR-ed
    in by :meth:`exchange_now`. Every rank must make the same sequence of calls."""

    def __init__(self, group: ProcessGroup | None, width: int) -> None:
        self.group = group
        self.width = width
        self._pending: tuple[Any, torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return self.group is not None and is_distributed()

    @property
    def pending(self) -> bool:
        """An overlapped exchange was launched and not read yet."""
        return self._pending is not None

    def exchange(self, flags: list[int], overlap: bool = False) -> list[int]:
        """Agree on ``flags`` (MAX over ranks); overlapped: returns the previous launch's result
        (zeros if none) and launches this one."""
        if not overlap:
            return self.exchange_now(flags)
        if not self.active:
            return [int(v) for v in flags]
        previous = self.flush()  # (started a step ago: done by now, in the common case)
        self.launch(flags)
        return previous

    def launch(self, flags: list[int]) -> None:
        """Start agreeing on ``flags`` without waiting (active only); :meth:`flush` reads it.
        Collective: every rank launches at the same boundary."""
        assert self.active and self._pending is None, "flush() the pending exchange first"
        local = torch.tensor(flags, dtype=torch.int32)
        self._pending = (dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group, async_op=True), local)

    def exchange_now(self, flags: list[int]) -> list[int]:
        """Complete a pending exchange and agree on ``flags`` right now."""
        earlier = self.flush()
        if not self.active:
            return [max(a, int(b)) for a, b in zip(earlier, flags, strict=True)]
        local = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return [max(a, int(b)) for a, b in zip(earlier, local.tolist(), strict=True)]

    def flush(self) -> list[int]:
        """Wait for an overlapped exchange and return its result (zeros if none is pending);
        every rank, at the same boundary, and before leaving the loop."""
        if self._pending is None:
            return [0] * self.width
        work, tensor = self._pending
        self._pending = None
        work.wait()
        return [int(v) for v in tensor.tolist()]
