"""Our extension of DCP's storage layer: checksums while writing, no rename to commit.

We keep DCP's file format (``__{rank}_{i}.distcp`` + pickled ``.metadata``) so plain
``torch.distributed.checkpoint`` can still read the tensor shards, and change only how
bytes reach storage:

* every file goes through :meth:`Store.open_write` (durable on close: fsync locally,
  completed upload remotely) and a CRC32C is computed on the bytes as they stream by;
* ``.metadata`` is written directly, not as ``.metadata.tmp`` + rename: on object stores
  rename is copy + delete (35 s on the GCS emulator for 64 MiB). Our manifest, written
  after DCP finishes, is the commit marker, so ``.metadata`` needs no atomicity.
* DCP calls ``torch.save`` for every tensor; the zip CRC-32 it computes per record cost
  ~0.55 s per GiB here (one thread, about as long as the disk write) and ``torch.load``
  never checks it. Our writer threads skip it (:func:`_skip_zip_crc32`): the CRC32C of
  every file in the manifest covers the same bytes. The records then carry CRC 0;
  ``torch.load`` / ``dcp.load`` read them as usual.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import posixpath
import threading
from collections.abc import Iterator
from typing import Any

import torch.serialization
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.format.manifest import FileEntry
from lightning_preempt.format.names import DCP_METADATA_NAME
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import Store

_thread_state = threading.local()


def _install_zip_crc32_switch() -> None:
    """Wrap ``torch.serialization.get_crc32_options`` once so a thread can opt out.

    torch.save reads the (process-global) option when it opens its zip writer; the
    wrapper answers ``False`` only inside :func:`_skip_zip_crc32` on the current thread,
    so torch.save calls in other threads (training, user code) are unaffected.
    """
    original = getattr(torch.serialization, "get_crc32_options", None)
    if original is None or getattr(original, "_lightning_preempt", False):
        return

    def get_crc32_options() -> bool:
        if getattr(_thread_state, "skip_zip_crc32", False):
            return False
        return bool(original())

    get_crc32_options._lightning_preempt = True  # type: ignore[attr-defined]
    get_crc32_options.__doc__ = original.__doc__
    torch.serialization.get_crc32_options = get_crc32_options


@contextlib.contextmanager
def _skip_zip_crc32() -> Iterator[None]:
    """torch.save in this thread writes zip records without CRC-32 (CRC32C covers them)."""
    _install_zip_crc32_switch()
    previous = getattr(_thread_state, "skip_zip_crc32", False)
    _thread_state.skip_zip_crc32 = True
    try:
        yield
    finally:
        _thread_state.skip_zip_crc32 = previous


class _HashingStream(io.RawIOBase):
    """Forwards writes to ``inner`` while counting bytes and updating a CRC32C."""

    def __init__(self, inner: Any, errors: list[BaseException]) -> None:
        super().__init__()
        self._inner = inner
        self._errors = errors
        self.crc = Crc32c()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        try:
            self._inner.write(view)
        except Exception as err:
            # torch.save's zip writer replaces this error with its own ("unexpected pos"):
            # keep the storage's own words for the user.
            self._errors.append(err)
            raise
        self.crc.update(view)
        return view.nbytes

    def tell(self) -> int:
        return self.crc.nbytes

    def flush(self) -> None:
        self._inner.flush()


class _ChecksummingFileSystem(_compat.FsspecFileSystem):
    def __init__(self, store: Store, entries: dict[str, FileEntry]) -> None:
        super().__init__()
        self.fs = store.dcp_filesystem()  # what DCP's own code may still call; our writes go through the Store
        self._store = store
        self._entries = entries
        self._lock = threading.Lock()
        self.storage_errors: list[BaseException] = []

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        # DCP's writer calls this; fsspec's makedirs would *create the bucket* on object
        # stores (s3fs, gcsfs). Store.makedirs only checks that it exists there.
        self._store.makedirs()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = posixpath.basename(os.fspath(path))
        with self._store.open_write(name) as raw, _skip_zip_crc32():
            stream = _HashingStream(raw, self.storage_errors)
            yield stream
        with self._lock:
            self._entries[name] = FileEntry(stream.crc.nbytes, stream.crc.hexdigest())


class ChecksummingWriter(_compat.FsspecWriter):
    """A DCP ``StorageWriter`` that records a :class:`FileEntry` for every file it writes.

    After ``dcp.save`` returns, :attr:`entries` holds this rank's files (and ``.metadata``
    on the coordinator).
    """

    def __init__(self, store: Store, *, thread_count: int = 1) -> None:
        super().__init__(
            store.url,
            single_file_per_rank=True,
            sync_files=False,  # Store.open_write makes each file durable itself
            thread_count=thread_count,
            overwrite=True,
            **store.storage_options,
        )
        self.entries: dict[str, FileEntry] = {}
        self._checksumming_fs = _ChecksummingFileSystem(store, self.entries)
        self.fs = self._checksumming_fs  # type: ignore[assignment]
        self.path = store.path()
        self._store = store

    @property
    def storage_error(self) -> BaseException | None:
        """The first error the storage raised while this rank wrote (DCP may mask it)."""
        errors = self._checksumming_fs.storage_errors
        return errors[0] if errors else None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        version = _compat.dcp_format_version()
        if version is not None:  # torch >= 2.7 (as its own FileSystemWriter.finish does)
            metadata.version = version
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        with self.fs.create_stream(posixpath.join(self.path, DCP_METADATA_NAME), "wb") as f:
            pickle.dump(metadata, f)

