"""The parts of :class:`~lightning_preempt.storage.store.Store` only object stores need
(``gs://``, ``s3://``; docs/object-stores.md): a fresh listing that reads folder markers,
the bucket check (a bucket is never created), bounded uploads that a failure aborts, and
the CRC32C that GCS keeps for an object.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import posixpath
from typing import Any

import fsspec
from fsspec.spec import AbstractBufferedFile

from lightning_preempt.errors import CheckpointWriteError

#: Buckets already checked, per protocol and storage options: one look a process.
_BUCKETS_SEEN: set[tuple[str, str, str]] = set()


def listing(fs: fsspec.AbstractFileSystem, base: str) -> list[tuple[str, str, int | None]]:
    """``(name, kind, size)`` of the entries directly under ``base`` (``kind``: ``"dir"`` or
    ``"file"``), fresh from the server; empty when ``base`` does not exist."""
    fs.invalidate_cache()  # the servers are consistent, fsspec's listing cache is not
    base = base.rstrip("/")
    try:
        entries = fs.ls(base, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: dict[str, tuple[str, int | None]] = {}
    for e in entries:
        name = str(e["name"])
        stripped = name.rstrip("/")
        if not stripped or stripped == base:
            continue
        # a zero-byte "folder marker" object (``run/step-1/``) also denotes a directory
        is_dir = e.get("type") == "directory" or (name.endswith("/") and not e.get("size"))
        size = e.get("size")
        out[posixpath.basename(stripped)] = ("dir", None) if is_dir else ("file", None if size is None else int(size))
    return sorted((name, kind, size) for name, (kind, size) in out.items())


def check_bucket(fs: fsspec.AbstractFileSystem, protocol: str, bucket: str, options: dict[str, Any], url: str) -> None:
    """Raise :class:`CheckpointWriteError` when ``bucket`` does not exist; inconclusive
    answers pass (the writes themselves tell). ``makedirs`` would create one for a mistyped URL."""
    key = (protocol, bucket, repr(sorted(options.items())))
    if not bucket or key in _BUCKETS_SEEN:
        return
    try:
        fs.info(bucket)
    except FileNotFoundError:
        # s3fs < 2025.10: info() of an *empty* bucket says "not found"; a listing tells.
        # Never fsspec's exists(): it answers False on any error (a 503, no permission).
        try:
            fs.ls(bucket)
        except FileNotFoundError:
            pass
        except Exception:  # inconclusive: the writes themselves tell
            return
        else:
            _BUCKETS_SEEN.add(key)
            return
        raise CheckpointWriteError(
            f"the bucket {bucket!r} does not exist",
            path=url,
            hint="lightning_preempt never creates buckets. Create it first (e.g. `gcloud storage buckets "
            f"create {protocol}://{bucket}` or `aws s3 mb s3://{bucket}`) with the location, access and "
            "lifecycle you want, or fix the URL.",
        ) from None
    except Exception:  # e.g. allowed to write objects but not to look at the bucket
        return
    _BUCKETS_SEEN.add(key)


def gcs_crc32c(info: dict[str, Any]) -> str | None:
    """The CRC32C (hex) in a GCS object's ``info()`` (base64, big-endian), else ``None``."""
    value = info.get("crc32c")
    try:
        raw = base64.b64decode(value, validate=True) if value else b""
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 4 else None


class BoundedWrites(io.RawIOBase):
    """Splits each ``write`` into ``chunk`` pieces: fsspec buffers a whole ``write()`` (a
    second 10 GB for a 10 GB tensor)."""

    def __init__(self, inner: Any, chunk: int) -> None:
        super().__init__()
        self._inner = inner
        self._chunk = chunk

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        for offset in range(0, view.nbytes, self._chunk):
            self._inner.write(view[offset : offset + self._chunk])
        return view.nbytes

    def tell(self) -> int:
        return int(self._inner.tell())

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        pass  # the owner (Store.open_write) closes or abandons the inner file


def abandon(f: Any) -> None:
    """Close ``f`` after a failure without publishing its bytes where we can."""
    if isinstance(f, AbstractBufferedFile):
        with contextlib.suppress(Exception):
            f.discard()  # abort the multi-part / resumable upload
        f.closed = True  # never let close() (or __del__) upload the partial data
        return
    with contextlib.suppress(Exception):
        f.close()
