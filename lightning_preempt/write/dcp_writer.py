"""Our extension of DCP's storage layer: checksums while writing, no rename to commit.

DCP's file format stays; every file goes through :meth:`Store.open_write` (durable on close)
with a CRC32C computed as the bytes stream by, the zip CRC-32 ``torch.save`` computes per
record (~0.55 s per GiB, never checked by ``torch.load``) is skipped, tensor records come
from per-shape templates through a buffered stream, and tensors the host-memory budget
streams are written first, so the save is released as soon as they are."""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, cast

import torch
import torch.serialization
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.format.manifest import FileEntry
from lightning_preempt.format.names import DCP_METADATA_NAME
from lightning_preempt.staging.budget import Streamed
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import Store
from lightning_preempt.write.dcp_exchange import SentResults, new_token, unwrap_metadata
from lightning_preempt.write.planning import PlanCache
from lightning_preempt.write.records import (
    Entry,
    RecordLayout,
    entry,
    gather,
    replay_file,
    results_of,
    write_tensor_record,
)

_thread_state = threading.local()
#: Writes smaller than this are gathered into one write (and one CRC32C update). 1 MiB
#: measured fastest here (8 MiB: 5x slower than unbuffered, the copy leaves the cache).
WRITE_BUFFER_BYTES = 1 << 20


def _install_zip_crc32_switch() -> None:
    """Wrap the process-global ``torch.serialization.get_crc32_options`` once: it answers
    ``False`` only inside :func:`_skip_zip_crc32` on the current thread, so torch.save calls
    in other threads (training, user code) are unaffected."""
    original = torch.serialization.get_crc32_options
    if getattr(original, "_lightning_preempt", False):
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
        # (a writer's streams are written only: DCP opens files to read in its readers)
        name = posixpath.basename(os.fspath(path))
        with self._store.open_write(name) as raw, _skip_zip_crc32():
            stream = _HashingStream(raw, self.storage_errors)
            # Small records (thousands of small tensors) reach storage and the CRC as a few
            # large writes; a write larger than the buffer goes straight through.
            buffered = io.BufferedWriter(stream, buffer_size=WRITE_BUFFER_BYTES)
            yield buffered
            buffered.flush()
        with self._lock:
            self._entries[name] = FileEntry(stream.crc.nbytes, stream.crc.hexdigest())


class ChecksummingWriter(_compat.FsspecWriter):
    """A DCP ``StorageWriter`` that records a :class:`FileEntry` for every file it writes.

    After ``dcp.save`` returns, :attr:`entries` holds this rank's files (and ``.metadata``
    on the coordinator).
    """

    def __init__(
        self,
        store: Store,
        *,
        thread_count: int = 1,
        streamed: Streamed | None = None,
        plan_cache: PlanCache | None = None,
    ) -> None:
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
        self.streamed = streamed
        #: plans, ``.metadata`` and file layouts of the previous saves (write/planning.py); a
        #: writer without one plans, pickles and lays out its one save afresh
        self.plan_cache = plan_cache if plan_cache is not None else PlanCache()

    @property
    def storage_error(self) -> BaseException | None:
        """The first error the storage raised while this rank wrote (DCP may mask it)."""
        errors = self._checksumming_fs.storage_errors
        return errors[0] if errors else None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's layout (``single_file_per_rank``: one ``{prefix}{i}.distcp`` per writer
        thread, items split by size; DCP's global plan gives every rank its prefix) with each
        tensor written by :func:`write_tensor_record`. Every item is a tensor (the saver hands
        DCP flat tensors only) and no stream transform is set (none is passed to DCP's writer)."""
        prefix = plan.storage_data.prefix
        streamed = self.streamed
        if streamed is not None:
            streamed.check()  # a second attempt of a save whose streamed tensors have changed
        cache = self.plan_cache
        layout = cache.records
        state_dict = getattr(planner, "state_dict", None)
        if (
            streamed is None
            and layout is not None
            and getattr(planner, "reused_local_plan", False)
            and isinstance(state_dict, dict)
            and layout.fits(plan.items, _file_names(prefix, len(plan.items), self.thread_count))
        ):
            return self._replay(layout, state_dict)
        items = list(plan.items)
        names = _file_names(prefix, len(items), self.thread_count)
        buckets = _compat.split_by_size(len(names), items)  # items by size, as DCP's own writer splits them
        # DCP logs two debug records per resolve_data call (~40 us a tensor); its
        # undecorated method resolves the same data.
        method = getattr(type(planner).resolve_data, "__wrapped__", None)
        resolve = (lambda item: method(planner, item)) if method is not None else planner.resolve_data
        live = streamed.keys if streamed is not None else frozenset()
        # streamed tensors first in every bucket: the save blocks until they are written
        if live:
            buckets = [sorted(b, key=lambda item: item.index.fqn not in live) for b in buckets]
        remaining = [sum(item.index.fqn in live for bucket in buckets for item in bucket)]
        count_lock = threading.Lock()
        # the layout to replay while this plan holds (planned structures of plain tensors only)
        record = streamed is None and getattr(planner, "structure_cached", False)
        files: list[list[Entry]] = [[] for _ in buckets]

        def written_live() -> None:
            with count_lock:
                remaining[0] -= 1
                done = remaining[0] == 0
            if done and streamed is not None:
                streamed.release()

        if streamed is not None and remaining[0] == 0:
            streamed.release()

        def write(name: str, bucket: list[WriteItem], entries: list[Entry]) -> list[WriteResult]:
            results: list[WriteResult] = []
            with self.fs.create_stream(posixpath.join(self.path, name), "wb") as stream:
                for item in bucket:
                    tensor = resolve(item)
                    assert isinstance(tensor, torch.Tensor)
                    offset = stream.tell()
                    parts = None
                    if item.index.fqn in live:
                        assert streamed is not None
                        with streamed.on_host(tensor) as host:
                            # (returns once the bytes left the chunk: written, or copied into
                            # the stream's buffer)
                            write_tensor_record(cast(IO[bytes], stream), host)
                        written_live()
                    else:
                        assert tensor.device.type == "cpu"
                        parts = write_tensor_record(cast(IO[bytes], stream), tensor.detach())
                    length = stream.tell() - offset
                    if record:
                        entries.append(entry(item, tensor, parts, length))
                    info = _compat.DcpStorageInfo(name, offset, length)
                    results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
            return results

        def remember(results: list[list[WriteResult]]) -> list[WriteResult]:
            if record:
                layout = cache.records = RecordLayout(plan.items, names, files, results)
                return SentResults(layout.flat, layout.token, same=False)  # in full, once per layout
            return [r for part in results for r in part]

        cache.records = None  # (a failed write leaves no layout behind)
        return _run_files(lambda i: write(names[i], buckets[i], files[i]), len(buckets), remember)

    def _replay(self, layout: RecordLayout, state_dict: dict[str, Any]) -> Future[list[WriteResult]]:
        """:meth:`write_data` of a plan written before (write/records.py: RecordLayout)."""

        moved: list[int] = []
        segments = layout.segments
        if segments is None:  # the first replay of this layout (or buffers were released since)
            segments = layout.segments = [gather(entries, state_dict) for entries in layout.files]

        def write(i: int) -> list[WriteResult]:
            name, entries = layout.names[i], layout.files[i]
            with self.fs.create_stream(posixpath.join(self.path, name), "wb") as stream:
                changed = replay_file(cast(IO[bytes], stream), segments[i], entries, state_dict)
            if changed:  # a torch.save record of another length: its place and those after it moved
                layout.results[i] = results_of(name, entries, changed)
                layout.files[i] = [e._replace(length=changed.get(p, e.length)) for p, e in enumerate(entries)]
                moved.append(i)
            return layout.results[i]

        def finish(_: list[list[WriteResult]]) -> list[WriteResult]:
            if moved:
                layout.flat = [r for part in layout.results for r in part]
                layout.token = new_token()
            # the same list while nothing moved: .metadata's places are known, and only its
            # token goes to the coordinator (write/dcp_exchange.py)
            return SentResults(layout.flat, layout.token, same=not moved)

        return _run_files(write, len(layout.names), finish)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata = unwrap_metadata(metadata)
        pickles = self.plan_cache.metadata_pickles
        results = self.plan_cache.results_kept.resolve(results)  # tokens of results sent before: the lists kept
        version = _compat.dcp_format_version()
        if version is not None:  # torch >= 2.7 (as its own FileSystemWriter.finish does)
            metadata.version = version
        metadata.storage_meta = self.storage_meta()
        with self.fs.create_stream(posixpath.join(self.path, DCP_METADATA_NAME), "wb") as f:
            f.write(pickles.dumps(metadata, results))  # storage_data set, the entries pickled once per plan


def _run_files(
    write: Callable[[int], list[WriteResult]], count: int, finish: Callable[[list[list[WriteResult]]], list[WriteResult]]
) -> Future[list[WriteResult]]:
    """``write(i)`` for every file (a thread each when more than one), ``finish`` of their
    results, as DCP's Future (which carries an error to DCP, to report per rank)."""
    done: Future[list[WriteResult]] = Future()
    try:
        if count == 1:
            done.set_result(finish([write(0)]))
        else:
            with ThreadPoolExecutor(count, thread_name_prefix="lp-write") as pool:
                parts = [pool.submit(write, i) for i in range(count)]
                done.set_result(finish([part.result() for part in parts]))
    except BaseException as err:
        done.set_exception(err)  # type: ignore[arg-type]  # torch's stub is too narrow
    return done


def _file_names(prefix: str, items: int, thread_count: int) -> list[str]:
    """The files of a plan: one per thread, at most one per item."""
    count = 1 if thread_count <= 1 or items <= 1 else min(thread_count, items)
    return [f"{prefix}{i}.distcp" for i in range(count)]
