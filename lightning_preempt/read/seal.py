"""A tier-0 copy's seal: its files were CRC32C-verified on this node since they last changed, so
a load from tmpfs may skip that check, a third of its time (why it is sound, in full: docs/tier0.md,
"The seal").

* **Written after a full check**, on the job thread once the copy (and its peer copy) committed:
  only files whose size and CRC32C match the manifest and whose status did not change while read
  (``fstat`` before and after). Per file: the manifest's (size, CRC32C), the inode's identity and
  times; and the boot id. Written atomically after the manifest: a killed copy has no manifest and
  so no seal; a torn seal does not parse.
* **Any change breaks it**: a write, truncation, rename over the file, ``chmod`` or ``utime`` sets
  the ctime, which no system call sets back; a file whose ctime is within ``FRESH_NS`` of the
  sealing (the ctime clock's tick) is not sealed.
* **Only tmpfs, only this boot, all or nothing**: a disk directory is always verified; one file not
  sealed or changed and every byte is checked. The sizes are always checked.

Not covered: a RAM error in the tmpfs pages (ECC memory is the guard, as for the live model), a
process writing through a shared mapping it held before the seal (none of our writers map files).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import SEAL_NAME
from lightning_preempt.storage import local
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.private import read_private, write_private

log = logging.getLogger(__name__)

FRESH_NS = 50_000_000  # a ctime this close to the sealing time is not trusted (coarse clock)
_CHUNK = 8 << 20
MAX_SEAL_BYTES = 64 << 20  # a seal lists each file of one copy (~150 B each)


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def on_tmpfs(path: str) -> bool:
    """Whether ``path`` lies on a tmpfs mount (the longest mount point above it)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, parts[2]
    except OSError:
        return False
    return kind == "tmpfs"


def _ident(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _verify_file(path: str, size: int, crc32c: str) -> list[int] | None:
    """The file's identity if its bytes match (size, CRC32C) and it did not change while read."""
    try:
        f = local.open_regular(path)  # a regular file, not through a symlink: a FIFO cannot hang it
    except OSError:
        return None
    with f:
        before = os.fstat(f.fileno())
        if before.st_size != size or time.time_ns() - before.st_ctime_ns < FRESH_NS:
            return None
        crc = Crc32c()
        while chunk := f.read(_CHUNK):
            crc.update(chunk)
        after = os.fstat(f.fileno())
    if crc.nbytes != size or crc.hexdigest() != crc32c or _ident(before) != _ident(after):
        return None
    return _ident(after)


def seal(step_dir: str, manifest: Manifest) -> bool:
    """Verify every file of ``manifest`` under ``step_dir`` and write the seal; whether it was
    written (not on a non-tmpfs directory, nor when a file fails or is too fresh)."""
    boot = boot_id()
    if boot is None or not on_tmpfs(step_dir):
        return False
    time.sleep(FRESH_NS / 1e9)  # the files just written leave the ctime clock's tick
    files: dict[str, Any] = {}
    for name, entry in manifest.files.items():
        ident = _verify_file(os.path.join(step_dir, name), entry.size, entry.crc32c)
        if ident is None:
            log.debug("lightning_preempt: tier-0 seal of %s: %s not sealed", step_dir, name)
            return False
        files[name] = {"size": entry.size, "crc32c": entry.crc32c, "ident": ident}
    try:  # 0600, a fresh temporary name never followed (storage/private.py)
        write_private(os.path.join(step_dir, SEAL_NAME), json.dumps({"version": 1, "boot_id": boot, "files": files}).encode())
    except OSError as err:
        log.debug("lightning_preempt: tier-0 seal of %s not written (%s)", step_dir, err)
        return False
    return True


def sealed(step_dir: str, manifest: Manifest) -> bool:
    """Whether every file of ``manifest`` under ``step_dir`` is as it was when sealed on this
    node since this boot (then its CRC32C need not be computed again). Never raises."""
    try:
        # A regular file of this uid only: a FIFO planted there cannot hang the load.
        data = json.loads(read_private(os.path.join(step_dir, SEAL_NAME), max_bytes=MAX_SEAL_BYTES))
        boot = boot_id()
        if not isinstance(data, dict) or data.get("version") != 1 or boot is None or data.get("boot_id") != boot:
            return False
        files = data.get("files")
        if not isinstance(files, dict) or set(files) != set(manifest.files) or not on_tmpfs(step_dir):
            return False
        for name, entry in manifest.files.items():
            rec = files[name]
            if not isinstance(rec, dict) or rec.get("size") != entry.size or rec.get("crc32c") != entry.crc32c:
                return False
            if _ident(os.lstat(os.path.join(step_dir, name))) != rec.get("ident"):
                return False
    except (OSError, ValueError, TypeError, KeyError):
        return False
    return True
