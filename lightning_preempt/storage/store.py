"""Storage: with :mod:`~lightning_preempt.storage.object_store` (the bucket-only parts), the
only modules that talk to fsspec (docs/object-stores.md).

A :class:`Store` is rooted at one ``str`` URL (``gs://…`` is not a ``Path``); other paths
are relative to it. Primitives only (list, stat, read, durable write, create-only commit,
delete); what a caller derives from them lives with it. Every answer is fresh. On object
stores nothing is ever renamed (``mv`` there is copy + delete), uploads are bounded and a
failure aborts them, and a bucket is never created.
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

from lightning_preempt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
)
from lightning_preempt.storage import local, object_store, reach
from lightning_preempt.storage.diagnose import describe, is_transient
from lightning_preempt.storage.protocols import OBJECT_STORES, protocol_of
from lightning_preempt.storage.retry import Backoff, retry

log = logging.getLogger(__name__)

#: Bytes per upload request (GCS chunk / S3 part): 10,000 S3 parts hold ~312 GiB.
UPLOAD_BLOCK_SIZE = 32 << 20
#: Bytes per step when a file is streamed: per-call cost vanishes, still cache-sized for hashing.
CHUNK_BYTES = 8 << 20

Kind = Literal["file", "dir", "link", "other"]

#: A short blip (NFS failover, a 503) passes; a lasting failure is raised within a fraction of a second.
STAT_BACKOFF = Backoff(attempts=3, backoff_s=0.1, transient=is_transient)


class Entry(NamedTuple):
    """One entry: ``"link"`` is a local symlink (never followed); ``size`` for files only."""

    name: str
    kind: Kind
    size: int | None = None


class Store:
    """A directory-like place addressed by URL; ``storage_options`` go to fsspec, never to logs."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = str(url).rstrip("/") or str(url)
        self.storage_options = dict(storage_options or {})
        self.protocol = protocol_of(self.url)
        reach.require_reachable(self.protocol, self.storage_options, self.url)  # seconds, not minutes of retries
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self._fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") if root != "/" else root
        self.is_local = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def path(self, rel: str = "") -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> Store:
        """The store rooted at ``rel``, of this class (a subclass's behaviour carries over)."""
        return type(self)(self.url_of(rel), self.storage_options)

    def parent(self) -> Store:
        return type(self)(posixpath.dirname(self.url.rstrip("/")), self.storage_options)

    @property
    def is_object_store(self) -> bool:
        """``gs://``, ``s3://``: directories are prefixes (``P`` and ``P/x`` can coexist), no rename."""
        return not self.is_local and self.protocol in OBJECT_STORES

    def dcp_filesystem(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, for DCP's ``FsspecReader`` / ``FsspecWriter`` only."""
        return self._fs

    def entries(self, rel: str = "") -> list[Entry]:
        """Every entry directly in ``rel``, by name (empty when missing); symlinks never followed."""
        found = local.scan(self.path(rel)) if self.is_local else object_store.listing(self._fs, self.path(rel))
        return [Entry(name, cast(Kind, kind), size) for name, kind, size in found]

    def stat(self, rel: str = "") -> Entry | None:
        """The entry at ``rel`` (through local symlinks), or ``None`` when the store says absent.

        Any other error is retried (:data:`STAT_BACKOFF`), then raised, never ``None``: that
        would make a committed checkpoint look partial (why fsspec's ``exists()`` is unused)."""
        name = posixpath.basename(self.path(rel).rstrip("/"))

        def look(attempt: int) -> Entry | None:
            if self.is_local:
                found = local.stat_entry(self.path(rel))
                return Entry(name, cast(Kind, found[0]), found[1]) if found is not None else None
            try:
                info = self.info(rel)
            except FileNotFoundError:
                return None
            if info.get("type") == "directory":
                return Entry(name, "dir")
            return Entry(name, "file", None if info.get("size") is None else int(info["size"]))

        return retry(look, STAT_BACKOFF, on_retry=functools.partial(_stat_retrying, self, rel))

    def info(self, rel: str = "") -> dict[str, Any]:
        """fsspec's ``info`` of ``rel``, fresh from the server."""
        self._fs.invalidate_cache(self.path(rel))
        return dict(self._fs.info(self.path(rel)))

    def open_read(self, rel: str) -> IO[bytes]:
        """Open ``rel`` only if it is a regular file (checkpoints are untrusted input);
        else :class:`CorruptCheckpointError`."""
        if not self.is_local:
            # a cached size of a replaced object makes gcsfs 2024.12 read that many bytes
            self._fs.invalidate_cache(self.path(rel))
            return self._fs.open(self.path(rel), "rb")  # type: ignore[no-any-return]
        try:
            return local.open_regular(self.path(rel))
        except local.NotRegularFileError as err:
            raise not_regular(self, rel, err.what) from None

    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes:
        """All of ``rel`` (:meth:`open_read`); more than ``max_bytes`` raises without reading the rest."""
        with self.open_read(rel) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:
            raise CorruptCheckpointError(
                f"{rel} is larger than the {max_bytes} bytes allowed",
                path=self.url,
                hint="The checkpoint is damaged or was not written by lightning_preempt; delete it.",
            )
        return data  # type: ignore[no-any-return]

    def makedirs(self, rel: str = "") -> None:
        """Create ``rel`` and its parents; on object stores only check that the bucket exists
        (:class:`CheckpointWriteError` when it does not; inconclusive answers pass): ``makedirs``
        would create one for a mistyped URL."""
        if not self.is_object_store:
            self._fs.makedirs(self.path(rel), exist_ok=True)
            return
        object_store.check_bucket(self._fs, self.protocol, self.root.split("/", 1)[0], self.storage_options,
                                  self.url)  # fmt: skip

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A stream durable once the block exits cleanly; a failure removes the partial file.
        Not atomic: for names nobody reads before the commit."""
        path = self.path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with local.durable_file(path) as out:
                yield out
            return
        f = self._fs.open(path, "wb", block_size=UPLOAD_BLOCK_SIZE)
        try:
            yield cast(IO[bytes], object_store.BoundedWrites(f, UPLOAD_BLOCK_SIZE))
            f.close()
        except BaseException:
            object_store.abandon(f)
            with contextlib.suppress(Exception):
                self._fs.rm_file(path)  # not rm(): it would read "[...]" in a path as a glob
            raise

    def commit_bytes(self, rel: str, data: bytes, *, exclusive: bool = True, durable: bool = True) -> None:
        """Create ``rel`` holding ``data`` atomically (one PUT on object stores).

        ``exclusive``: create-only; different bytes already there raise
        :class:`CheckpointExistsError`, the same bytes count as success (a retried PUT).
        ``durable=False`` (local disk): no syncs, for names whose loss is harmless.
        """
        path = self.path(rel)
        try:
            if self.is_local:
                local.write_atomic(path, data, exclusive=exclusive, durable=durable)
            elif not exclusive:
                self._fs.pipe_file(path, data)
            else:
                # the emulator ignores ifGenerationMatch; real GCS and S3 honour the PUT below
                if self.stat(rel) is not None:
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
        """Delete the file (or local symlink) ``rel``, if there; ``durable=False``: no dir sync."""
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self.path(rel))
        if not self.is_local:
            self._fs.invalidate_cache(self.path(rel))
        elif durable:
            local.fsync_dir(os.path.dirname(self.path(rel)))

    def rm_tree(self, rel: str = "", *, owned: local.Owned) -> None:
        """Delete ``rel`` and all below it, only with its ownership verdict (:class:`local.Owned`).
        fsspec reads ``[``/``*`` in remote paths as globs: our names never have them."""
        if self.is_local:
            local.remove_local(self.path(rel), owned=owned)
            return
        local.require(owned, self.path(rel))
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self.path(rel), recursive=True)
        self._fs.invalidate_cache()


def _stat_retrying(store: Store, rel: str, err: BaseException, attempt: int, delay: float) -> None:
    log.warning("lightning_preempt: cannot tell whether %s exists (%s); attempt %d of %d, retrying in %.1fs",
                store.url_of(rel), describe(err, store.storage_options), attempt, STAT_BACKOFF.attempts,
                delay)  # fmt: skip


def not_regular(store: Store, rel: str, what: str) -> CorruptCheckpointError:
    """The error for a read of ``rel`` refused because it is ``what`` (a symlink, a FIFO…)."""
    return CorruptCheckpointError(
        f"{rel!r} in the checkpoint is {what}, not a regular file; refusing to read it",
        path=store.url,
        hint="Checkpoint files are always regular files. Someone else wrote this one: inspect and delete it "
        "(docs/security.md).",
    )


def kind_at(store: Store, rel: str = "") -> Kind | None:
    """What :meth:`Store.stat` finds at ``rel``: ``"file"``, ``"dir"``…, ``None`` when absent."""
    entry = store.stat(rel)
    return None if entry is None else entry.kind


def files_below(store: Store, rel: str = "") -> list[str]:
    """Every file under ``rel``, recursively, as sorted paths relative to ``rel``."""
    out = []
    for e in store.entries(rel):
        if e.kind == "file":
            out.append(e.name)
        elif e.kind == "dir":
            out += [f"{e.name}/{inner}" for inner in files_below(store, posixpath.join(rel, e.name))]
    return sorted(out)


def join_url(url: str, *parts: str) -> str:
    return "/".join([str(url).rstrip("/"), *[p.strip("/") for p in parts]])
