"""Archives that every zip reader reads alike (issue 55; docs/security.md, "One reading").

Python's ``zipfile`` and torch's reader (miniz) disagree on crafted archives: miniz looks a
name up ignoring case, ``zipfile`` takes the exact name (the last when listed twice); for
data before the archive ``zipfile`` shifts every offset and miniz does not, so an archive
glued after another is read from its own directory by one and from the other's by the
other. A file that ``torch.save`` wrote has none of this: its entries follow each other from
byte 0, then the central directory, then the end record, which ends the file. Such an
archive has one reading; anything else is refused. No torch here (``verify`` runs it).
"""

from __future__ import annotations

import struct
import zipfile

_EOCD = struct.Struct("<4s4H2LH")  # signature, disk numbers, entry counts, cd size, cd offset, comment length
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, the zip64 end record's offset, disks
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # ..., entries on disk, entries, cd size, cd offset
_LOCAL = struct.Struct("<4s5H3L2H")  # ..., name length, extra length


class AmbiguousArchive(ValueError):
    """Two zip readers could read different records from this archive."""


def check_one_reading(data: bytes, archive: zipfile.ZipFile) -> None:
    """Raise :class:`AmbiguousArchive` unless ``data`` (opened as ``archive``) is laid out as
    ``torch.save`` writes: no two names equal ignoring case, the end record last with no
    comment, the central directory right before it (or before its zip64 records), and the
    entries back to back from byte 0 up to the central directory, each local header naming
    the entry its directory entry names (then its data, then its data descriptor)."""
    infos = archive.infolist()
    names = [i.filename for i in infos]
    if len({n.lower() for n in names}) != len(names):  # (miniz lowers ASCII; this, every letter)
        raise AmbiguousArchive("two records whose names differ only in case (or one listed twice)")
    cd_end, count, cd_size, cd_offset = _central_directory(data)
    if count != len(infos) or cd_offset + cd_size != cd_end:
        raise AmbiguousArchive("the central directory is not the one right before the end record")
    pos = 0
    for info in sorted(infos, key=lambda i: i.header_offset):
        if info.header_offset != pos:
            raise AmbiguousArchive(f"a gap or an overlap before {info.filename!r}")
        header = data[pos : pos + _LOCAL.size]
        if len(header) < _LOCAL.size or header[:4] != b"PK\x03\x04":
            raise AmbiguousArchive(f"no local header for {info.filename!r}")
        name_len, extra_len = _LOCAL.unpack(header)[-2:]
        local_name = data[pos + _LOCAL.size : pos + _LOCAL.size + name_len]
        if local_name != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
            raise AmbiguousArchive(f"the local header of {info.filename!r} names another record")
        pos += _LOCAL.size + name_len + extra_len + info.compress_size
        if info.flag_bits & 0x08:  # the sizes follow the data (torch.save's miniz writes them so)
            pos += _descriptor_size(data, pos, info)
    if pos != cd_offset:
        raise AmbiguousArchive("bytes between the last record and the central directory")


def _descriptor_size(data: bytes, pos: int, info: zipfile.ZipInfo) -> int:
    """The size of the data descriptor at ``pos`` (signed, 32- or 64-bit sizes), which must
    repeat the central directory's CRC and sizes."""
    if data[pos : pos + 4] != b"PK\x07\x08":
        raise AmbiguousArchive(f"no data descriptor after {info.filename!r}")
    expected = (info.CRC, info.compress_size, info.file_size)
    for size, fmt in ((16, "<LLL"), (24, "<LQQ")):
        if pos + size <= len(data) and struct.unpack_from(fmt, data, pos + 4) == expected:
            return size
    raise AmbiguousArchive(f"the data descriptor of {info.filename!r} differs from its directory entry")


def _central_directory(data: bytes) -> tuple[int, int, int, int]:
    """Where the central directory must end (the zip64 end record, else the end record), its
    entry count, size and offset, from an end record that is the file's last 22 bytes."""
    eocd_at = len(data) - _EOCD.size
    if eocd_at < 0:
        raise AmbiguousArchive("too short for a zip archive")
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(data, eocd_at)
    if sig != b"PK\x05\x06" or comment or disk or cd_disk:
        raise AmbiguousArchive("bytes after the archive's end record (or a comment, or several disks)")
    locator_at = eocd_at - _ZIP64_LOCATOR.size
    if locator_at < 0 or data[locator_at : locator_at + 4] != b"PK\x06\x07":
        return eocd_at, count, cd_size, cd_offset
    _, _, record_at, _ = _ZIP64_LOCATOR.unpack_from(data, locator_at)
    if record_at + _ZIP64_EOCD.size != locator_at or data[record_at : record_at + 4] != b"PK\x06\x06":
        raise AmbiguousArchive("a zip64 end record that is not right before its locator")
    _, _, _, _, _, _, _, count64, cd_size64, cd_offset64 = _ZIP64_EOCD.unpack_from(data, record_at)
    return record_at, count64, cd_size64, cd_offset64
