"""DCP tensor records written without a ``torch.save`` call per tensor: per (dtype, shape), a
template cut from ``torch.save``'s own archive around the data record, checked before use
(docs/design.md, "The writer's fast paths"); the bytes are a valid ``torch.save`` archive.
And the shard files' layout of one save plan (:class:`RecordLayout`: each item's key, template
and length), recorded by a plan's first save and replayed while the plan holds."""

from __future__ import annotations

import dataclasses
import io
import threading
from collections import OrderedDict
from typing import IO, Any, NamedTuple, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.read.archive import data_start
from lightning_preempt.write.dcp_exchange import new_token

#: Tensors up to this size are written from a template (the template's allocation is
#: transient and per shape); larger ones by ``torch.save`` (one call per many MiB).
TEMPLATE_MAX_BYTES = 16 << 20
#: Templates kept (one per dtype and shape; a few KiB each).
MAX_TEMPLATES = 1024
#: A replayed file's consecutive small template records go to storage joined into writes of
#: about this size (one ``write`` and one CRC32C update each, not three Python calls a record).
GATHER_BYTES = 1 << 20
#: Records whose data is larger are written apart (a join would copy their bytes once more).
GATHER_MAX_DATA = 64 << 10

_templates: OrderedDict[tuple[bool, torch.dtype, tuple[int, ...]], tuple[bytes, bytes] | None] = OrderedDict()
_lock = threading.Lock()


def _archive(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _build(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """(head, tail) around the data of an archive of this kind, or ``None`` when archives
    of it are not the same bytes around the data (see the module docstring)."""
    first = torch.zeros(shape, dtype=dtype)
    second = torch.empty(shape, dtype=dtype)
    second.view(-1).view(torch.uint8).fill_(0x5A)
    a, b = _archive(first), _archive(second)
    nbytes = first.numel() * first.element_size()
    start = data_start(memoryview(a[:4096]))
    if start is None or len(a) != len(b) or start + nbytes > len(a):
        return None
    end = start + nbytes
    same_around = a[:start] == b[:start] and a[end:] == b[end:]
    if not same_around or b[start:end] != bytes(_data_of(second)):
        return None
    return a[:start], a[end:]


def _template(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    # Keyed on the zip CRC-32 setting too: with it on, archives differ by data and no
    # template holds (a None cached then must not outlive the setting).
    key = (bool(torch.serialization.get_crc32_options()), tensor.dtype, tuple(tensor.shape))
    with _lock:
        if key in _templates:
            _templates.move_to_end(key)
            return _templates[key]
    built = _build(key[1], key[2])
    with _lock:
        _templates[key] = built
        while len(_templates) > MAX_TEMPLATES:
            _templates.popitem(last=False)
    return built


def _templatable(tensor: torch.Tensor) -> bool:
    nbytes = tensor.numel() * tensor.element_size()
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == nbytes
        and 0 < nbytes <= TEMPLATE_MAX_BYTES
        and not tensor.is_quantized
        and not tensor.is_neg()
        and not tensor.is_conj()
    )


def write_tensor_record(stream: IO[bytes], tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """Write ``tensor`` to ``stream`` as the ``torch.save`` archive DCP stores per chunk;
    returns the template's ``(head, tail)`` used, ``None`` when ``torch.save`` wrote it. The
    caller has turned the zip CRC-32 off; templates are built and checked under that setting."""
    parts = _template(tensor) if _templatable(tensor) else None
    if parts is None:
        torch.save(tensor, stream)
        return None
    head, tail = parts
    stream.write(head)
    stream.write(_data_of(tensor))
    stream.write(tail)
    return parts


def clear_templates() -> None:
    """Forget every template (tests; a process that changed torch's serialization options)."""
    with _lock:
        _templates.clear()


#: What :func:`replay_file` writes: the position of a ``torch.save`` record (written again and
#: its length compared), or buffers written in order, joined into one write when ``True``.
Segment = int | tuple[bool, list[Any]]


class Entry(NamedTuple):
    """One record: the tensor's key, its template (``None``: ``torch.save``), its length."""

    fqn: str
    where: MetadataIndex  # the item's index in the plan
    head: bytes | None
    tail: bytes
    length: int
    as_numpy: bool  # numpy has the dtype: the bytes without a uint8 view


@dataclasses.dataclass
class RecordLayout:
    """The files one plan wrote (see the module docstring), to write again while it holds."""

    items: list[WriteItem]
    names: list[str]
    files: list[list[Entry]]
    results: list[list[WriteResult]]
    #: every file's results in one list (what DCP gets; the same object while nothing moved)
    flat: list[WriteResult] = dataclasses.field(default_factory=list)
    #: names ``flat`` as the coordinator received it (write/dcp_exchange.py); new when it changes
    token: str = dataclasses.field(default_factory=new_token)
    #: per file, what :func:`replay_file` writes (views of the staged tensors' bytes),
    #: made by the first replay; dropped when a buffer is released (PlanCache.forget_views)
    segments: list[list[Segment]] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.flat = [r for part in self.results for r in part]

    def fits(self, items: list[WriteItem], names: list[str]) -> bool:
        return names == self.names and (items is self.items or items == self.items)


def entry(item: WriteItem, tensor: torch.Tensor, parts: tuple[bytes, bytes] | None, length: int) -> Entry:
    """What :func:`replay_file` needs of one record just written (``parts``: its template)."""
    try:
        tensor.numpy()
        as_numpy = True
    except (TypeError, RuntimeError):  # bfloat16, float8: no numpy dtype
        as_numpy = False
    head, tail = parts if parts is not None else (None, b"")
    return Entry(item.index.fqn, item.index, head, tail, length, as_numpy)


def results_of(name: str, entries: list[Entry], changed: dict[int, int]) -> list[WriteResult]:
    """The ``WriteResult`` s of a file whose record lengths ``changed`` (by position)."""
    results: list[WriteResult] = []
    offset = 0
    for position, record in enumerate(entries):
        length = changed.get(position, record.length)
        info = _compat.DcpStorageInfo(name, offset, length)
        results.append(WriteResult(index=record.where, size_in_bytes=length, storage_data=info))
        offset += length
    return results


def _data_of(tensor: torch.Tensor, as_numpy: bool = False) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (``as_numpy``: numpy has its dtype)."""
    data = tensor.numpy() if as_numpy else tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(cast(Any, data)).cast("B")


def gather(entries: list[Entry], state_dict: dict[str, Any]) -> list[Segment]:
    """The segments of one file (see :data:`Segment`): runs of template records up to
    :data:`GATHER_BYTES` joined, a record with more than :data:`GATHER_MAX_DATA` of data apart.
    The views are of ``state_dict``'s tensors: valid while the same tensors are replayed
    (a reused plan: the same objects at the same addresses, write/planning.py)."""
    segments: list[Segment] = []
    run: list[Any] = []
    size = 0
    for position, (fqn, _, head, tail, _length, as_numpy) in enumerate(entries):
        if head is None:
            if run:
                segments.append((True, run))
                run, size = [], 0
            segments.append(position)
            continue
        data = _data_of(state_dict[fqn], as_numpy)
        if data.nbytes > GATHER_MAX_DATA:
            if run:
                segments.append((True, run))
                run, size = [], 0
            segments.append((False, [head, data, tail]))
            continue
        run += (head, data, tail)
        size += len(head) + data.nbytes + len(tail)
        if size >= GATHER_BYTES:  # (at least the stream's buffer: it passes straight through)
            segments.append((True, run))
            run, size = [], 0
    if run:
        segments.append((True, run))
    return segments


def replay_file(
    stream: IO[bytes], segments: list[Segment], entries: list[Entry], state_dict: dict[str, Any]
) -> dict[int, int]:
    """Write ``entries``' records (``segments``: :func:`gather` of them) of the tensors in
    ``state_dict`` to ``stream``; returns the lengths of the ``torch.save`` records (by
    position) that differ from last time."""
    write = stream.write
    changed: dict[int, int] = {}
    for segment in segments:
        if type(segment) is int:
            record = entries[segment]
            start = stream.tell()
            write_tensor_record(stream, state_dict[record.fqn].detach())
            if stream.tell() - start != record.length:
                changed[segment] = stream.tell() - start
            continue
        joined, parts = cast(tuple[bool, list[Any]], segment)
        if joined:
            write(b"".join(parts))
        else:
            for part in parts:
                write(part)
    return changed
