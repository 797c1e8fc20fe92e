"""CRC32C checksums (what GCS keeps per object): the ``crc32c`` package, ~12 GB/s, any
buffer without a copy, GIL released."""

from __future__ import annotations

import crc32c as _crc32c


class Crc32c:
    """Incremental CRC32C over a byte stream."""

    __slots__ = ("_crc", "nbytes")

    def __init__(self, data: bytes | bytearray | memoryview = b"") -> None:
        self._crc = 0
        self.nbytes = 0
        self.update(data)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._crc = _crc32c.crc32c(view, self._crc)
        self.nbytes += view.nbytes

    def extend(self, other: Crc32c) -> None:
        """Become the CRC of this stream followed by ``other``'s (computed apart, e.g. by
        another thread over the next range of a file), without reading the bytes again."""
        self._crc = combine(self._crc, other._crc, other.nbytes)
        self.nbytes += other.nbytes

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"


_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def _gf2_times(mat: list[int], vec: int) -> int:
    total, i = 0, 0
    while vec:
        if vec & 1:
            total ^= mat[i]
        vec >>= 1
        i += 1
    return total


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's
    ``crc32_combine``, with the Castagnoli polynomial): ~60 32x32 GF(2) matrix squarings."""
    if len2 <= 0:
        return crc1
    odd = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    op = _gf2_square(even)  # four zero bits
    while len2:
        op = _gf2_square(op)  # then one zero byte, two, four...: one bit of len2 each
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
    return crc1 ^ crc2
