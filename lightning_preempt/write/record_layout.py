"""The shard files' layout of one save plan, replayed while the plan holds: each item's key,
template and length, recorded by the first save of a plan (docs/design.md, "The writer's
fast paths"). The bytes are those the item by item path writes."""

from __future__ import annotations

import dataclasses
from typing import IO, Any, NamedTuple, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.write.dcp_exchange import new_token
from lightning_preempt.write.records import write_tensor_record


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
    """The files one plan wrote (see the module docstring)."""

    items: list[WriteItem]
    names: list[str]
    files: list[list[Entry]]
    results: list[list[WriteResult]]
    #: every file's results in one list (what DCP gets; the same object while nothing moved)
    flat: list[WriteResult] = dataclasses.field(default_factory=list)
    #: names ``flat`` as the coordinator received it (write/dcp_exchange.py); new when it changes
    token: str = dataclasses.field(default_factory=new_token)

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


def replay_file(stream: IO[bytes], entries: list[Entry], state_dict: dict[str, Any]) -> dict[int, int]:
    """Write ``entries``' records of the tensors in ``state_dict`` to ``stream``; returns the
    lengths of the ``torch.save`` records (by position) that differ from last time."""
    write = stream.write
    changed: dict[int, int] = {}
    for position, (fqn, _, head, tail, length, as_numpy) in enumerate(entries):
        tensor = state_dict[fqn]
        if head is None:
            start = stream.tell()
            write_tensor_record(stream, tensor.detach())
            if stream.tell() - start != length:
                changed[position] = stream.tell() - start
            continue
        data = tensor.numpy() if as_numpy else tensor.reshape(-1).view(torch.uint8).numpy()
        write(head)
        write(memoryview(cast(Any, data)).cast("B"))
        write(tail)
    return changed


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
