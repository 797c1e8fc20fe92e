"""One ``torch.save`` archive (a DCP tensor record) read straight into its tensor.

Only the zip local headers are parsed (no unpickling): the head goes to scratch, the data
record into a tensor of the chunk's size, the data descriptor confirms it. Any other layout
falls back to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import sys
from typing import IO, Any, NamedTuple, cast

import torch

from lightning_preempt.read.crc_reader import Cursor, read_into


class TensorItem(NamedTuple):
    """One tensor chunk's archive in a shard file (from DCP's ``.metadata``). (A named
    tuple: thousands are made per load, ~4x faster than a frozen dataclass.)"""

    fqn: str
    file: str
    offset: int  # of the archive in the file
    length: int
    dtype: torch.dtype
    chunk_offsets: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    full_size: tuple[int, ...]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, writable, without a copy."""
    return memoryview(cast(Any, t.numpy())).cast("B")


#: The head of an archive read first: torch.save's records before the tensor data
#: (data.pkl, .format_version, .storage_alignment, byteorder) take well under 1 KiB.
_HEAD_BYTES = 4096
_LOCAL_HEADER = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"


def read_archive(f: IO[bytes], item: TensorItem, crc: Cursor,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, int]:  # fmt: skip
    """Read one archive of ``item.length`` bytes from ``f`` into a tensor of its own storage.
    Returns ``(tensor, bytes read)``; ``None`` for a short read."""
    head = memoryview(bytearray(min(item.length, _HEAD_BYTES)))
    got = read_into(f, head, crc)
    if got < head.nbytes:
        return None, got
    nbytes = math.prod(item.chunk_sizes) * item.dtype.itemsize
    start = data_start(head)
    if start is None or sys.byteorder != "little":
        rest = memoryview(bytearray(item.length - head.nbytes))
        got += read_into(f, rest, crc)
        return (_load_archive(bytes(head) + bytes(rest), item) if got == item.length else None), got
    tensor = out if out is not None else torch.empty(item.chunk_sizes, dtype=item.dtype)
    data = _bytes_of(tensor.view(-1).view(torch.uint8)) if nbytes else memoryview(bytearray())
    in_head = max(0, min(head.nbytes, start + nbytes) - start)
    data[:in_head] = head[start : start + in_head]
    got += read_into(f, data[in_head:], crc)
    rest = memoryview(bytearray(max(0, item.length - max(head.nbytes, start + nbytes))))
    got += read_into(f, rest, crc)
    if got < item.length:
        return None, got
    # The data descriptor right after the data records the record's real size.
    after = bytes(head[start + nbytes :]) + bytes(rest[:24]) if start + nbytes < head.nbytes else bytes(rest[:24])
    if not _descriptor_says(after, nbytes):
        whole = bytes(head) + bytes(data[in_head:]) + bytes(rest)  # the archive as it was in the file
        return _load_archive(whole, item), got
    return tensor, got


def archive_in_memory(
    archive: memoryview, item: TensorItem, layouts: dict[tuple[int, int], int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensor of one archive already in memory, copied into a tensor of its own.
    ``layouts`` remembers where the data header sat for archives of the same sizes, so the
    headers are walked only on a miss. :class:`Unparsable` when torch cannot read it."""
    nbytes = math.prod(item.chunk_sizes) * item.dtype.itemsize
    shape = (archive.nbytes, nbytes)
    header = layouts.get(shape)
    start = _data_after(archive, header) if header is not None else None
    if start is None:
        header = _data_header(archive[:_HEAD_BYTES])
        start = _data_after(archive, header) if header is not None else None
        if header is not None and start is not None:
            layouts[shape] = header
    end = start + nbytes if start is not None else -1
    if (
        start is None
        or sys.byteorder != "little"
        or end > archive.nbytes
        or not _descriptor_says(bytes(archive[end : end + 24]), nbytes)
    ):
        return _load_archive(bytes(archive), item)
    tensor = out if out is not None else torch.empty(item.chunk_sizes, dtype=item.dtype)
    if nbytes:
        _bytes_of(tensor.view(-1).view(torch.uint8))[:] = archive[start:end]
    return tensor


def data_start(head: memoryview) -> int | None:
    """Offset of the ``*/data/0`` record's data in an archive whose first bytes are ``head``."""
    header = _data_header(head)
    return _data_after(head, header) if header is not None else None


def _data_header(head: memoryview) -> int | None:
    """Offset of the first local header named ``*/data/0`` in ``head``."""
    raw = bytes(head)
    pos = 0
    while (pos := raw.find(_LOCAL_HEADER, pos)) >= 0 and pos + 30 <= len(raw):
        name_len = int.from_bytes(raw[pos + 26 : pos + 28], "little")
        extra_len = int.from_bytes(raw[pos + 28 : pos + 30], "little")
        if raw[pos + 30 : pos + 30 + name_len].endswith(b"/data/0"):
            return pos
        pos += 30 + name_len + extra_len  # skip this header (its data follows; headers are searched for)
    return None


def _data_after(archive: memoryview, pos: int) -> int | None:
    """Where the data of the stored ``*/data/0`` record whose local header is at ``pos``
    starts, or ``None`` when no such header is there (or its data is compressed)."""
    fixed = archive[pos : pos + 30]
    if fixed.nbytes < 30 or fixed[:4] != _LOCAL_HEADER or fixed[8:10] != b"\x00\x00":  # method 0: stored
        return None
    name_len = fixed[26] | fixed[27] << 8
    extra_len = fixed[28] | fixed[29] << 8
    if name_len < 7 or archive[pos + 30 + name_len - 7 : pos + 30 + name_len] != b"/data/0":
        return None
    return pos + 30 + name_len + extra_len


def _descriptor_says(after: bytes, nbytes: int) -> bool:
    """Whether the zip data descriptor in ``after`` records ``nbytes`` for the record."""
    if not after.startswith(_DESCRIPTOR):
        return False
    size32 = int.from_bytes(after[12:16], "little") if len(after) >= 16 else -1
    size64 = int.from_bytes(after[16:24], "little") if len(after) >= 24 else -1
    return nbytes in (size32, size64)


class Unparsable(Exception):
    """An archive read in full that torch cannot turn into the expected tensor."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _load_archive(archive: bytes, item: TensorItem) -> torch.Tensor:
    try:
        tensor = torch.load(io.BytesIO(archive), map_location="cpu", weights_only=True)
        return tensor.reshape(item.chunk_sizes)
    except Exception as err:  # garbage bytes raise anything from the zip reader or unpickler
        raise Unparsable(err) from err
