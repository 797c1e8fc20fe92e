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

from lightning_preempt import _compat
from lightning_preempt.checksum import Crc32c
from lightning_preempt.manifest import FileEntry, Manifest
from lightning_preempt.safe_load import read_dcp_metadata
from lightning_preempt.storage import Store

DCP_METADATA_NAME = ".metadata"

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
        self.fs = store.fs
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


class _CheckedReader(_compat.FsspecReader):
    """DCP's reader with ``.metadata`` read through :func:`safe_load.read_dcp_metadata`:
    a restricted unpickler and a check that it names only tensors in our shard files."""

    def __init__(self, store: Store, manifest: Manifest | None) -> None:
        super().__init__(store.url, **store.storage_options)
        self.fs.fs = store.fs  # type: ignore[attr-defined]  # the Store's filesystem (e.g. plain gcsfs against an emulator)
        self._store = store
        self._manifest = manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(self._store, self._manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata  # type: ignore[no-any-return]


def dcp_reader(store: Store, manifest: Manifest | None = None) -> _compat.FsspecReader:
    """A DCP reader for the shards of a checkpoint directory (``manifest``: the files its
    ``.metadata`` may refer to)."""
    return _CheckedReader(store, manifest)


def load_all_tensors(store: Store, *, manifest: Manifest | None = None) -> dict[str, Any]:
    """Every tensor of the shards, full (unsharded), on CPU, in this process alone.

    ``dcp.load`` needs a template; with none we use the empty-state-dict planner the way
    DCP's own ``format_utils.dcp_to_torch_save`` does.
    """
    tensors: dict[str, Any] = {}
    _compat.dcp_load_state_dict(
        tensors, storage_reader=dcp_reader(store, manifest), planner=_compat.EmptyStateDictLoadPlanner(), no_dist=True
    )
    return tensors


def load_tensors_into(
    store: Store, tensors: dict[str, Any], *, process_group: Any = None, manifest: Manifest | None = None
) -> None:
    """Fill ``tensors`` (plain or ``DTensor``) in place from the shards, resharding as DCP
    does. Collective over ``process_group`` when torch.distributed is initialised."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_available() and dist.is_initialized()
    dcp.load(tensors, storage_reader=dcp_reader(store, manifest), process_group=process_group, no_dist=not distributed)
