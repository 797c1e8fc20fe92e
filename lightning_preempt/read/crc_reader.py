"""Reading a file range by range with its CRC32C computed on the way.

:func:`hashing_reader` hashes each storage read as it arrives, so thousands of small records
cost a few large reads. Each range has a CRC32C of its own, computed by the thread reading it;
the file's is theirs combined in file order (:func:`file_digest`).
"""

from __future__ import annotations

import io
from typing import IO, Any, cast

from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import CHUNK_BYTES

#: What one read from storage asks for when the parser wants less (small records).
READ_BUFFER_BYTES = 1 << 20


class Cursor:
    """Where one reading thread is in the file."""

    def __init__(self, offset: int) -> None:
        self.offset = offset


def read_into(f: IO[bytes], view: memoryview, cursor: Cursor) -> int:
    """Fill ``view`` from ``f`` chunk by chunk, moving ``cursor``; returns bytes read."""
    done = 0
    while done < view.nbytes:
        n = _readinto(f, view[done : done + CHUNK_BYTES])
        if n == 0:
            break
        done += n
    cursor.offset += done
    return done


def _readinto(f: IO[bytes], view: memoryview) -> int:
    readinto = getattr(f, "readinto", None)
    if readinto is not None:
        return readinto(view) or 0
    data = f.read(view.nbytes)  # a file object without readinto: one extra copy
    view[: len(data)] = data
    return len(data)


def file_digest(crcs: list[Crc32c]) -> str:
    """The file's CRC32C from its ranges' (in file order)."""
    whole = Crc32c()
    for part in crcs:
        whole.extend(part)
    return whole.hexdigest()


class _HashingRaw(io.RawIOBase):
    """The raw side of :func:`hashing_reader`: every byte read from ``inner`` goes to the
    CRC (synchronously: the buffer it lands in is reused by the next fill)."""

    def __init__(self, inner: IO[bytes], crc: Crc32c | None, offset: int, end: int | None) -> None:
        super().__init__()
        self._inner = inner
        self._crc = crc
        self.offset = offset
        self._end = end

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._end is not None:  # never read ahead into the next range (another reader's bytes)
            view = view[: max(0, self._end - self.offset)]
        if not view.nbytes:
            return 0
        n = _readinto(self._inner, view)
        if n and self._crc is not None:
            self._crc.update(view[:n])
        self.offset += n
        return n


def hashing_reader(inner: IO[bytes], crc: Crc32c | None, offset: int, end: int | None = None) -> IO[bytes]:
    """A buffered reader over ``inner`` from ``offset`` to ``end`` that hands every byte read to
    ``crc``; reads of :data:`READ_BUFFER_BYTES` or more go straight into the caller's memory."""
    return cast(IO[bytes], io.BufferedReader(_HashingRaw(inner, crc, offset, end), READ_BUFFER_BYTES))
