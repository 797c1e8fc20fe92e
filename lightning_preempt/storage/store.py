"""Storage: the only module that talks to fsspec.

Paths stay ``str`` URLs (``gs://bucket/run`` is not a ``pathlib.Path``). A :class:`Store`
is rooted at one URL; every other path it takes is relative to that root, with ``/``.

Durability: a write to local disk is durable once ``close()`` returns because we fsync
the file (and, for commits, the directory); an object-store write is durable once the
upload completes. Commits never rename on object stores (``mv`` there is copy + delete).

Object stores (``gs://``, ``s3://``):

* large writes stream in blocks of :data:`UPLOAD_BLOCK_SIZE` (resumable upload on GCS,
  multi-part upload on S3); we split every ``write()`` so fsspec never buffers more than
  about two blocks, even when DCP hands over a multi-GB tensor in one call;
* a failed write aborts the upload (nothing half-written becomes an object);
* :meth:`Store.commit_bytes` is one small PUT, create-only where the store supports a
  conditional write (GCS ``ifGenerationMatch=0``, S3 ``If-None-Match: *``);
* "directories" are prefixes; :meth:`Store.list_dirs` lists them.

GCS emulators need ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` set before gcsfs is imported
(gcsfs >= 2026 probes each bucket over gRPC, which an emulator never answers); that is the
test set-up's business (tests/conftest.py), not this module's.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import io
import os
import posixpath
import stat
import uuid
from collections.abc import Iterator
from typing import IO, Any, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from lightning_preempt.errors import CheckpointExistsError, CheckpointWriteError, CorruptCheckpointError

#: Bytes per upload request (GCS resumable chunk / S3 part). S3 allows 10,000 parts, so
#: one file can hold up to ~312 GiB at this size.
UPLOAD_BLOCK_SIZE = 32 << 20

_GCS_PROTOCOLS = ("gs", "gcs")



class Store:
    """A directory-like place addressed by URL: local disk, ``memory://``, ``gs://``, ``s3://``…

    ``storage_options`` go to fsspec unchanged (credentials, ``endpoint_url``…); they are
    never logged.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = str(url).rstrip("/") or str(url)
        self.storage_options = dict(storage_options or {})
        self.protocol = self.url.split("://", 1)[0].lower() if "://" in self.url else "file"
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") if root != "/" else root
        self.is_local = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # ---- paths -------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The filesystem-native path of ``rel`` (for fsspec calls)."""
        return posixpath.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str = "") -> str:
        """The URL of ``rel``, in the same form as :attr:`url`."""
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> Store:
        return Store(self.url_of(rel), self.storage_options)

    # ---- queries -----------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def isdir(self, rel: str = "") -> bool:
        return bool(self.fs.isdir(self.path(rel)))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def info(self, rel: str) -> dict[str, Any]:
        return dict(self.fs.info(self.path(rel)))

    def remote_crc32c(self, rel: str, info: dict[str, Any] | None = None) -> str | None:
        """The CRC32C (8 hex digits) the store itself keeps for ``rel``, or ``None``.

        GCS keeps one for every object (``info()["crc32c"]``, base64 big-endian); for
        other stores this returns ``None`` (computing it would mean reading the file).
        """
        if self.protocol not in _GCS_PROTOCOLS:
            return None
        value = (info if info is not None else self.info(rel)).get("crc32c")
        if not value:
            return None
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
        return raw.hex() if len(raw) == 4 else None

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the sub-directories of ``rel`` (empty when ``rel`` does not exist).

        On object stores these are the common prefixes below ``rel/``. On local disk a
        symlink is never listed: reading or deleting through it would leave ``rel``.
        """
        if self.is_local:
            return sorted(name for name, kind in self.children(rel) if kind == "dir")
        self.invalidate_cache()
        base = self.path(rel).rstrip("/")
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        names = set()
        for e in entries:
            name = str(e["name"])
            # a zero-byte "folder marker" object (``run/step-1/``) also denotes a directory
            if e.get("type") == "directory" or (name.endswith("/") and not e.get("size")):
                stripped = name.rstrip("/")
                if stripped and stripped != base:
                    names.add(posixpath.basename(stripped))
        return sorted(names)

    def children(self, rel: str = "") -> list[tuple[str, str]]:
        """``(name, kind)`` of every entry directly in ``rel``; ``kind`` is ``"file"``
        (a regular file), ``"dir"``, ``"link"`` (local symlink, never followed) or
        ``"other"`` (FIFO, socket, device). Empty when ``rel`` does not exist."""
        if self.is_local:
            try:
                with os.scandir(self.path(rel)) as it:
                    return sorted((e.name, _kind(e)) for e in it)
            except (FileNotFoundError, NotADirectoryError):
                return []
        self.invalidate_cache()
        base = self.path(rel).rstrip("/")
        try:
            entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        out: dict[str, str] = {}
        for e in entries:
            name = str(e["name"])
            stripped = name.rstrip("/")
            if not stripped or stripped == base:
                continue
            is_dir = e.get("type") == "directory" or (name.endswith("/") and not e.get("size"))
            out[posixpath.basename(stripped)] = "dir" if is_dir else "file"
        return sorted(out.items())

    def list_files(self, rel: str = "") -> list[str]:
        """Relative paths of every file below ``rel``."""
        self.invalidate_cache()
        base = self.path(rel).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(posixpath.relpath(p, base) for p in found if not p.endswith("/"))

    def invalidate_cache(self) -> None:
        # fsspec caches listings; the servers are consistent but the cache is not.
        self.fs.invalidate_cache()

    # ---- reads -------------------------------------------------------------------------
    # ---- reads: checkpoints are untrusted input (docs/security.md) ----------------------
    def open_read(self, rel: str) -> IO[bytes]:
        """Open ``rel`` for reading only if it is a regular file, not through a symlink.

        On local disk the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with
        ``fstat`` on the open descriptor (no race): a symlink, FIFO (which would block the
        open), socket or device raises :class:`CorruptCheckpointError`. Object stores
        hold only plain objects. Raises ``FileNotFoundError`` when ``rel`` is missing.
        """
        if not self.is_local:
            # The listing cache may hold the size of an object since replaced (a manifest
            # swap); gcsfs 2024.12 then reads that many bytes of the new one. Ask afresh.
            self.fs.invalidate_cache(self.path(rel))
            return self.fs.open(self.path(rel), "rb")  # type: ignore[no-any-return]
        path = self.path(rel)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except OSError as err:
            if err.errno == errno.ELOOP or (err.errno == errno.EMLINK and os.path.islink(path)):
                raise _not_regular(self, rel, "a symbolic link") from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise _not_regular(self, rel, _describe_mode(mode))
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def read_bytes(self, rel: str) -> bytes:
        """All of ``rel`` (a regular file, see :meth:`open_read`)."""
        with self.open_read(rel) as f:
            return f.read()

    def read_regular(self, rel: str, max_bytes: int) -> bytes:
        """All of ``rel`` (see :meth:`open_read`); more than ``max_bytes`` raises
        :class:`CorruptCheckpointError` without reading the rest."""
        with self.open_read(rel) as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise CorruptCheckpointError(
                f"{rel} is larger than the {max_bytes} bytes allowed",
                path=self.url,
                hint="The checkpoint is damaged or was not written by lightning_preempt; delete it.",
            )
        return data  # type: ignore[no-any-return]

    def check_regular(self, rel: str, size: int) -> None:
        """Cheap check (no data read) that ``rel`` is a regular file of ``size`` bytes and
        not a symlink: what loading without verification still insists on locally."""
        if not self.is_local:
            return
        st = os.lstat(self.path(rel))
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(self, rel, _describe_mode(st.st_mode))
        if st.st_size != size:
            raise CorruptCheckpointError(
                f"file {rel!r} has {st.st_size} bytes, the manifest says {size} (truncated?)",
                path=self.url,
                hint="This checkpoint is damaged; resume from an older one (auto-resume skips it).",
            )

    # ---- writes ------------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        """Create ``rel`` and its parents on local disk; on object stores only check that
        the bucket exists. A bucket is never created: fsspec's ``makedirs`` would create
        one (with default ACL, region and billing) for a mistyped URL."""
        if self.is_local or self.protocol not in _OBJECT_STORES:
            self.fs.makedirs(self.path(rel), exist_ok=True)
            return
        # object stores have no directories: a prefix exists once an object is under it
        self.require_bucket()

    def require_bucket(self) -> None:
        """Raise :class:`CheckpointWriteError` with a HINT when the bucket of this object
        store URL does not exist. Inconclusive answers (no permission to look) pass: the
        writes themselves then tell."""
        bucket = self.root.split("/", 1)[0]
        key = (self.protocol, bucket, repr(sorted(self.storage_options.items())))
        if not bucket or key in _BUCKETS_SEEN:
            return
        try:
            self.fs.info(bucket)
        except FileNotFoundError:
            if self.fs.exists(bucket):  # s3fs < 2025.10: info() of an *empty* bucket says "not found"
                _BUCKETS_SEEN.add(key)
                return
            raise CheckpointWriteError(
                f"the bucket {bucket!r} does not exist",
                path=self.url,
                hint="lightning_preempt never creates buckets. Create it first (e.g. `gcloud storage buckets "
                f"create {self.protocol}://{bucket}` or `aws s3 mb s3://{bucket}`) with the location, access and "
                "lifecycle you want, or fix the URL.",
            ) from None
        except Exception:  # e.g. allowed to write objects but not to look at the bucket
            return
        _BUCKETS_SEEN.add(key)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary stream whose bytes are durable once the ``with`` block exits cleanly.

        A failed block removes the partial file (and aborts an object-store upload) so it
        can never be mistaken for data.
        """
        path = self.path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed below
        else:
            f = self.fs.open(path, "wb", block_size=UPLOAD_BLOCK_SIZE)
        try:
            yield f if self.is_local else cast(IO[bytes], _BoundedWrites(f, UPLOAD_BLOCK_SIZE))
            if self.is_local:
                f.flush()
                os.fsync(f.fileno())
            f.close()
        except BaseException:
            _abandon(f)
            with contextlib.suppress(Exception):
                self.fs.rm(path)
            raise

    def commit_bytes(self, rel: str, data: bytes, *, exclusive: bool = True) -> None:
        """Create ``rel`` holding ``data`` atomically: readers see all of it or nothing.

        Local disk: temp file, fsync, then a hard link (create-only) or rename, fsync the
        directory. Object stores: a single small PUT is atomic by itself; we never rename
        there. With ``exclusive`` the write is create-only where the store supports a
        conditional write (local disk, GCS, S3): if ``rel`` already holds different bytes
        :class:`CheckpointExistsError` is raised. The same bytes count as success (a PUT
        retried after its answer was lost).
        """
        path = self.path(rel)
        if self.is_local:
            self._commit_local(path, data, exclusive=exclusive)
            return
        if not exclusive:
            self.fs.pipe_file(path, data)
            return
        # Cheap pre-check; the conditional PUT below is what makes it race-free (the GCS
        # emulator ignores ifGenerationMatch, real GCS and S3 honour it).
        self.fs.invalidate_cache(path)
        if self.fs.exists(path):
            self._raise_exists(rel, data)
            return
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            self._raise_exists(rel, data)

    def _commit_local(self, path: str, data: bytes, *, exclusive: bool) -> None:
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if not exclusive:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)  # atomic and create-only
                except FileExistsError:
                    self._raise_exists(posixpath.basename(path), data, local_path=path)
                except OSError:  # no hard links on this filesystem
                    if os.path.exists(path):
                        self._raise_exists(posixpath.basename(path), data, local_path=path)
                    else:
                        os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(directory)

    def _raise_exists(self, rel: str, data: bytes, *, local_path: str | None = None) -> None:
        try:
            if local_path is not None:
                with open(local_path, "rb") as f:
                    existing: bytes | None = f.read()
            else:
                existing = self.read_bytes(rel)
        except (OSError, ValueError):
            existing = None
        if existing == data:
            return
        raise CheckpointExistsError(
            f"{rel} already exists; refusing to overwrite it",
            path=self.url,
            hint="Another writer committed this checkpoint first (or it was saved before). Save to a new "
            "path, or remove the old checkpoint first if you really mean to replace it.",
        )

    def rm_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))
        if self.is_local:
            fsync_dir(os.path.dirname(self.path(rel)))
        else:
            self.fs.invalidate_cache(self.path(rel))

    def rm_tree(self, rel: str = "") -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=True)
        self.invalidate_cache()


_OBJECT_STORES = frozenset({"gs", "gcs", "s3", "s3a"})
_BUCKETS_SEEN: set[tuple[str, str, str]] = set()


def _kind(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "other"


def _describe_mode(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _not_regular(store: Store, rel: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{rel!r} in the checkpoint is {what}, not a regular file; refusing to read it",
        path=store.url,
        hint="Checkpoint files are always regular files. Someone else wrote this one: inspect and delete it "
        "(docs/security.md).",
    )


class _BoundedWrites(io.RawIOBase):
    """Splits each ``write`` into pieces of at most ``chunk`` bytes.

    fsspec's buffered files copy a whole ``write()`` into their buffer before uploading:
    DCP writing a 10 GB tensor would otherwise cost a second 10 GB in memory.
    """

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


def _abandon(f: Any) -> None:
    """Close ``f`` after a failure without publishing its bytes where we can."""
    if isinstance(f, AbstractBufferedFile):
        with contextlib.suppress(Exception):
            f.discard()  # abort the multi-part / resumable upload
        f.closed = True  # never let close() (or __del__) upload the partial data
        return
    with contextlib.suppress(Exception):
        f.close()


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable (POSIX needs the directory fsynced)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def join_url(url: str, *parts: str) -> str:
    return "/".join([str(url).rstrip("/"), *[p.strip("/") for p in parts]])
