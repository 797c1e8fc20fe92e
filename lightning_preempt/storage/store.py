"""Storage: the only module that talks to fsspec (docs/object-stores.md).

Paths stay ``str`` URLs (``gs://bucket/run`` is not a ``pathlib.Path``). A :class:`Store`
is rooted at one URL; every other path it takes is relative to that root, with ``/``.
A few primitives, the rest derived from them (fsspec's way): :meth:`Store.entries`,
:meth:`Store.stat` and :meth:`Store.info` answer what exists; :meth:`Store.open_read`,
:meth:`Store.open_write` and :meth:`Store.commit_bytes` (one small file, atomically,
create-only where the store can) move bytes; :meth:`Store.rm_file`, :meth:`Store.rm_tree`,
:meth:`Store.makedirs`. Every answer is fresh (fsspec's listing cache is invalidated first).

Durable means fsynced on local disk (storage/local.py), a completed upload on object
stores, where writes stream in blocks of :data:`UPLOAD_BLOCK_SIZE`, a failed write aborts
its upload, and nothing is ever renamed (``mv`` there is copy + delete).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
from collections.abc import Iterator
from typing import IO, Any, Literal, NamedTuple, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lightning_preempt.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from lightning_preempt.storage import local, reach, remote
from lightning_preempt.storage.diagnose import describe, is_transient
from lightning_preempt.storage.owned import Owned, require
from lightning_preempt.storage.retry import Backoff, retry

log = logging.getLogger(__name__)

#: Bytes per upload request (GCS resumable chunk / S3 part). S3 allows 10,000 parts, so
#: one file can hold up to ~312 GiB at this size.
UPLOAD_BLOCK_SIZE = 32 << 20
#: Bytes per step when a file is streamed: read for its CRC32C, copied by the drain, read
#: into tensors by the one-pass loader, sent to the peer replica. Large enough that the
#: per-call cost vanishes, small enough to stay in the CPU caches while it is hashed.
CHUNK_BYTES = 8 << 20

Kind = Literal["file", "dir", "link", "other"]

#: Attempts of one :meth:`Store.stat` that failed with something else than "absent": a
#: short blip (an NFS server failing over, a 503) passes, a lasting failure is raised
#: within a fraction of a second for the caller's own policy (resume retries its listing).
STAT_BACKOFF = Backoff(attempts=3, backoff_s=0.1, transient=is_transient)


class Entry(NamedTuple):
    """One entry of a store: ``kind`` is ``"file"`` (a regular file or object), ``"dir"``,
    ``"link"`` (local symlink, never followed) or ``"other"`` (FIFO, socket, device);
    ``size`` is known for files only."""

    name: str
    kind: Kind
    size: int | None = None


class Store:
    """A directory-like place addressed by URL: local disk, ``memory://``, ``gs://``, ``s3://``…

    ``storage_options`` go to fsspec unchanged (credentials, ``endpoint_url``…); they are
    never logged.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = str(url).rstrip("/") or str(url)
        self.storage_options = dict(storage_options or {})
        self.protocol = self.url.split("://", 1)[0].lower() if "://" in self.url else "file"
        reach.require_reachable(self.protocol, self.storage_options, self.url)  # seconds, not minutes of retries
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self._fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") if root != "/" else root
        self.is_local = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # ---- paths and kind of store -------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The filesystem-native path of ``rel`` (an OS path on local disk)."""
        return posixpath.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str = "") -> str:
        """The URL of ``rel``, in the same form as :attr:`url`."""
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> Store:
        """The store rooted at ``rel`` (of this class: a subclass's behaviour carries over)."""
        return type(self)(self.url_of(rel), self.storage_options)

    def parent(self) -> Store:
        """The store of the directory that holds this one (siblings of a path live there)."""
        return type(self)(posixpath.dirname(self.url.rstrip("/")), self.storage_options)

    @property
    def is_object_store(self) -> bool:
        """``gs://``, ``s3://``: "directories" are prefixes, so an object ``P`` and objects
        under ``P/`` can coexist (file systems, ``memory://`` included, cannot); no rename
        (``mv`` is copy + delete); create-only PUTs."""
        return not self.is_local and self.protocol in remote.OBJECT_STORES

    def dcp_filesystem(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem under this store, for DCP's ``FsspecReader`` / ``FsspecWriter``
        only (they take a filesystem object). Nothing else may use it: every other access goes
        through the methods of this class."""
        return self._fs

    # ---- primitives: what exists ---------------------------------------------------------
    def entries(self, rel: str = "") -> list[Entry]:
        """Every entry directly in ``rel``, by name (empty when ``rel`` does not exist). On
        local disk a symlink is listed as ``"link"`` and never followed: reading or deleting
        through it would leave ``rel``. On object stores directories are the common prefixes."""
        found = local.scan(self.path(rel)) if self.is_local else remote.listing(self._fs, self.path(rel))
        return [Entry(name, cast(Kind, kind), size) for name, kind, size in found]

    def stat(self, rel: str = "") -> Entry | None:
        """The entry at ``rel`` (through symlinks on local disk, as ``os.path.exists`` looks),
        or ``None`` when nothing is there.

        "Absent" is only ever the store's own answer (``ENOENT``, "not found"). Any other
        error (EIO on NFS or FUSE, a 503 from a bucket) is "could not tell": retried a few
        times (:data:`STAT_BACKOFF`, errors a retry cannot fix at once), then raised; never
        ``None``, which would make a committed checkpoint look partial. So :meth:`exists`,
        :meth:`isdir` and :meth:`is_file` raise too; fsspec's own ``exists()``, which
        answers ``False`` on any error, is never used."""
        name = posixpath.basename(self.path(rel).rstrip("/"))

        def look(attempt: int) -> Entry | None:
            if self.is_local:
                found = local.stat_entry(self.path(rel))
                return Entry(name, cast(Kind, found[0]), found[1]) if found is not None else None
            try:
                kind, size = remote.info_entry(self.info(rel))
            except FileNotFoundError:
                return None
            return Entry(name, cast(Kind, kind), size)

        return retry(look, STAT_BACKOFF, on_retry=functools.partial(_stat_retrying, self, rel))

    def info(self, rel: str = "") -> dict[str, Any]:
        """The store's own metadata of ``rel`` (fsspec's ``info``: size, type, ETag, crc32c…),
        fresh from the server. ``FileNotFoundError`` when missing."""
        self._fs.invalidate_cache(self.path(rel))
        return dict(self._fs.info(self.path(rel)))

    # ---- derived: what exists ------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        return self.stat(rel) is not None

    def isdir(self, rel: str = "") -> bool:
        entry = self.stat(rel)
        return entry is not None and entry.kind == "dir"

    def is_file(self, rel: str = "") -> bool:
        """A regular file (an object) is at ``rel`` (through symlinks on local disk)."""
        entry = self.stat(rel)
        return entry is not None and entry.kind == "file"

    def size(self, rel: str) -> int:
        entry = self.stat(rel)
        if entry is None:
            raise FileNotFoundError(self.url_of(rel))
        return int(entry.size) if entry.size is not None else int(self.info(rel).get("size", 0))

    def children(self, rel: str = "") -> list[tuple[str, str]]:
        """``(name, kind)`` of every entry directly in ``rel`` (see :meth:`entries`)."""
        return [(e.name, e.kind) for e in self.entries(rel)]

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the sub-directories of ``rel`` (never a symlink; empty when ``rel`` does not exist)."""
        return [e.name for e in self.entries(rel) if e.kind == "dir"]

    def list_files(self, rel: str = "") -> list[str]:
        """Relative paths (with ``/``) of every file below ``rel``, at any depth."""
        out = []
        for e in self.entries(rel):
            if e.kind == "file":
                out.append(e.name)
            elif e.kind == "dir":
                out += [f"{e.name}/{inner}" for inner in self.list_files(posixpath.join(rel, e.name))]
        return sorted(out)

    def remote_crc32c(self, rel: str, info: dict[str, Any] | None = None) -> str | None:
        """The CRC32C (8 hex digits) the store itself keeps for ``rel`` (GCS), else ``None``."""
        if self.protocol not in remote.GCS_PROTOCOLS:
            return None
        return remote.crc32c_of(info if info is not None else self.info(rel), self.protocol)

    # ---- primitives: reading -------------------------------------------------------------
    # Checkpoints are untrusted input (docs/security.md).
    def open_read(self, rel: str) -> IO[bytes]:
        """Open ``rel`` for reading only if it is a regular file, not through a symlink.

        On local disk a symlink, FIFO (which would block the open), socket or device raises
        :class:`CorruptCheckpointError` (:func:`local.open_regular`, no race). Object stores
        hold only plain objects. Raises ``FileNotFoundError`` when ``rel`` is missing.
        """
        if not self.is_local:
            # The listing cache may hold the size of an object since replaced (a manifest
            # swap); gcsfs 2024.12 then reads that many bytes of the new one. Ask afresh.
            self._fs.invalidate_cache(self.path(rel))
            return self._fs.open(self.path(rel), "rb")  # type: ignore[no-any-return]
        try:
            return local.open_regular(self.path(rel))
        except local.NotRegularFileError as err:
            raise _not_regular(self, rel, err.what) from None

    # ---- derived: reading ----------------------------------------------------------------
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
        try:
            actual = local.regular_size(self.path(rel))
        except local.NotRegularFileError as err:
            raise _not_regular(self, rel, err.what) from None
        if actual != size:
            raise CorruptCheckpointError(
                f"file {rel!r} has {actual} bytes, the manifest says {size} (truncated?)",
                path=self.url,
                hint="This checkpoint is damaged; resume from an older one (auto-resume skips it).",
            )

    # ---- primitives: writing -------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        """Create ``rel`` and its parents on local disk; on object stores only check that
        the bucket exists (a bucket is never created, :func:`remote.require_bucket`)."""
        if not self.is_object_store:
            self._fs.makedirs(self.path(rel), exist_ok=True)
            return
        # object stores have no directories: a prefix exists once an object is under it
        remote.require_bucket(self._fs, self.protocol, self.root, self.storage_options, self.url)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary stream whose bytes are durable once the ``with`` block exits cleanly.

        A failed block removes the partial file (and aborts an object-store upload) so it
        can never be mistaken for data. Not atomic: for names nobody reads before the commit.
        """
        path = self.path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed below
        else:
            f = self._fs.open(path, "wb", block_size=UPLOAD_BLOCK_SIZE)
        try:
            yield f if self.is_local else cast(IO[bytes], remote.BoundedWrites(f, UPLOAD_BLOCK_SIZE))
            if self.is_local:
                f.flush()
                local.sync_data(f.fileno())
            f.close()
        except BaseException:
            remote.abandon(f)
            with contextlib.suppress(Exception):
                self._fs.rm_file(path)  # not rm(): it would read "[...]" in a path as a glob
            raise

    def commit_bytes(self, rel: str, data: bytes, *, exclusive: bool = True, durable: bool = True) -> None:
        """Create ``rel`` holding ``data`` atomically: readers see all of it or nothing.

        Local disk: :func:`local.write_atomic` (temp file, fsync, hard link or rename, fsync
        the directory). Object stores: a single small PUT is atomic by itself; we never
        rename there. With ``exclusive`` the write is create-only where the store supports a
        conditional write (local disk, GCS, S3): if ``rel`` already holds different bytes
        :class:`CheckpointExistsError` is raised. The same bytes count as success (a PUT
        retried after its answer was lost). ``durable=False`` (local disk): no syncs, a crash
        may lose the file; only for names whose loss is harmless (the writer claim).
        """
        path = self.path(rel)
        try:
            if self.is_local:
                local.write_atomic(path, data, exclusive=exclusive, durable=durable)
            elif not exclusive:
                self._fs.pipe_file(path, data)
            else:
                # Cheap pre-check; the conditional PUT below is what makes it race-free (the
                # GCS emulator ignores ifGenerationMatch, real GCS and S3 honour it).
                if self.exists(rel):
                    raise FileExistsError(path)
                self._fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            self._raise_exists(rel, data)
        if not self.is_local:
            self._fs.invalidate_cache(path)

    def _raise_exists(self, rel: str, data: bytes) -> None:
        try:
            existing: bytes | None = self.read_bytes(rel)
        except (OSError, ValueError, CheckpointError):
            existing = None
        if existing == data:
            return
        raise CheckpointExistsError(
            f"{posixpath.basename(rel)} already exists; refusing to overwrite it",
            path=self.url,
            hint="Another writer committed this checkpoint first (or it was saved before). Save to a new "
            "path, or remove the old checkpoint first if you really mean to replace it.",
        )

    def rm_file(self, rel: str = "", *, durable: bool = True) -> None:
        """Delete the file (object, or local symlink itself) ``rel``; a missing one is fine.
        ``durable=False`` (local disk): the directory is not synced, a crash may bring the
        file back (only for names whose return is harmless: the writer claim)."""
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self.path(rel))
        if not self.is_local:
            self._fs.invalidate_cache(self.path(rel))
        elif durable:
            local.fsync_dir(os.path.dirname(self.path(rel)))

    def rm_tree(self, rel: str = "", *, owned: Owned) -> None:
        """Delete ``rel`` and everything below it (a local symlink: only the link); a missing
        one is fine. ``owned``: the ownership verdict for ``rel`` (storage/owned.py), without
        which nothing is deleted. Remote paths with glob characters (``[``, ``*``) are read as
        patterns by fsspec's recursive delete: our names never have them."""
        if self.is_local:
            local.remove_local(self.path(rel), owned=owned)
            return
        require(owned, self.path(rel))
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self.path(rel), recursive=True)
        self._fs.invalidate_cache()

    # ---- derived: writing ----------------------------------------------------------------
    def copy_file(self, src: str, dst: str) -> None:
        """Copy the file ``src`` to ``dst`` (both relative to this store), streamed; ``dst``
        is complete once this returns (see :meth:`open_write`)."""
        with self.open_read(src) as reader, self.open_write(dst) as writer:
            while chunk := reader.read(CHUNK_BYTES):
                writer.write(chunk)


def _stat_retrying(store: Store, rel: str, err: BaseException, attempt: int, delay: float) -> None:
    log.warning("lightning_preempt: cannot tell whether %s exists (%s); attempt %d of %d, retrying in %.1fs",
                store.url_of(rel), describe(err, store.storage_options), attempt, STAT_BACKOFF.attempts,
                delay)  # fmt: skip


def _not_regular(store: Store, rel: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{rel!r} in the checkpoint is {what}, not a regular file; refusing to read it",
        path=store.url,
        hint="Checkpoint files are always regular files. Someone else wrote this one: inspect and delete it "
        "(docs/security.md).",
    )


def join_url(url: str, *parts: str) -> str:
    return "/".join([str(url).rstrip("/"), *[p.strip("/") for p in parts]])
