"""Storage: the only module that talks to fsspec.

Paths stay ``str`` URLs (``gs://bucket/run`` is not a ``pathlib.Path``). A :class:`Store`
is rooted at one URL; every other path it takes is relative to that root, with ``/``.

Durability: a write to local disk is durable once ``close()`` returns because we fsync
the file (and, for commits, the directory); an object-store write is durable once the
upload completes. Commits never rename on object stores (``mv`` there is copy + delete).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem


class Store:
    """A directory-like place addressed by URL: local disk, ``memory://``, ``gs://``, ``s3://``…"""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = str(url).rstrip("/") or str(url)
        self.storage_options = dict(storage_options or {})
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

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the sub-directories of ``rel`` (empty when ``rel`` does not exist)."""
        self.invalidate_cache()
        try:
            entries = self.fs.ls(self.path(rel), detail=True)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory")

    def list_files(self, rel: str = "") -> list[str]:
        """Relative paths of every file below ``rel``."""
        self.invalidate_cache()
        base = self.path(rel).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(posixpath.relpath(p, base) for p in found)

    def invalidate_cache(self) -> None:
        # fsspec caches listings; the servers are consistent but the cache is not.
        self.fs.invalidate_cache()

    # ---- reads -------------------------------------------------------------------------
    def open_read(self, rel: str) -> IO[bytes]:
        return self.fs.open(self.path(rel), "rb")  # type: ignore[no-any-return]

    def read_bytes(self, rel: str) -> bytes:
        with self.open_read(rel) as f:
            return f.read()

    # ---- writes ------------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        self.fs.makedirs(self.path(rel), exist_ok=True)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary stream whose bytes are durable once the ``with`` block exits cleanly.

        A failed block removes the partial file so it can never be mistaken for data.
        """
        path = self.path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed below
        else:
            f = self.fs.open(path, "wb")
        try:
            yield f
            if self.is_local:
                f.flush()
                os.fsync(f.fileno())
            f.close()
        except BaseException:
            with contextlib.suppress(Exception):
                f.close()
            with contextlib.suppress(Exception):
                self.fs.rm(path)
            raise

    def commit_bytes(self, rel: str, data: bytes) -> None:
        """Create ``rel`` holding ``data`` atomically: readers see all of it or nothing.

        Local disk: temp file, fsync, rename, fsync the directory. Object stores: a single
        small PUT is atomic by itself; we never rename there.
        """
        path = self.path(rel)
        if self.is_local:
            directory = os.path.dirname(path)
            tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            fsync_dir(directory)
        else:
            self.fs.pipe_file(path, data)

    def rm_file(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))
        if self.is_local:
            fsync_dir(os.path.dirname(self.path(rel)))

    def rm_tree(self, rel: str = "") -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=True)


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
