"""One pass over the bytes on load: read each shard file once, straight into the memory
the tensors will live in, and compute its CRC32C on the way.

``dcp.load`` reads every tensor record into a ``BytesIO`` (copy 1), ``torch.load``s it
into a new storage (copy 2) and copies that into the destination (copy 3); a separate
verification pass read every byte before that. Here:

* the DCP ``.metadata`` says where every tensor's ``torch.save`` archive sits in which
  file; each file is read front to back: an archive's head (its small records) into
  scratch, then its tensor data with ``readinto`` straight into a new tensor of exactly
  that size, then its tail into scratch. The tensors *are* the read buffers, each with
  a storage of its own (optimizer state often stays the very tensor that was loaded:
  it must not keep other bytes alive, and torch.save of it must save only it);
* the CRC32C of the chunk just read runs on a second thread while the next chunk is
  read (both release the GIL), so verification costs no extra pass;
* files are read in parallel (a thread each, up to :data:`MAX_PARALLEL_FILES`);
* a file whose size or CRC32C disagrees with the manifest raises
  :class:`CorruptCheckpointError` before any tensor is returned.

Only the tensor records' zip headers are parsed (no unpickling): DCP's metadata already
holds each chunk's dtype and size, and our staged buffers are always contiguous; the
zip data descriptor after the data confirms the record's size. An archive laid out
otherwise (never written by us) falls back to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, cast

import torch

from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format.manifest import FileEntry
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import Store

#: Bytes read per ``readinto`` call; the CRC of one chunk overlaps the read of the next.
CHUNK_BYTES = 16 << 20
#: Ranges read at the same time, over all files.
MAX_PARALLEL_FILES = 4
#: A file at least this large is read in two ranges at once.
SPLIT_BYTES = 64 << 20

_CORRUPT_HINT = "This checkpoint is damaged; resume from an older one (auto-resume skips it)."


@dataclasses.dataclass(frozen=True)
class TensorItem:
    """One tensor chunk's archive in a shard file (from DCP's ``.metadata``)."""

    fqn: str
    file: str
    offset: int  # of the archive in the file
    length: int
    dtype: torch.dtype
    chunk_offsets: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    full_size: tuple[int, ...]


def tensor_items(metadata: Any) -> list[TensorItem] | None:
    """Every tensor chunk of ``metadata`` (a DCP ``Metadata``), or ``None`` when it holds
    anything this reader does not handle (non-tensor entries, transforms such as
    compression): the caller then takes DCP's own reader."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items: list[TensorItem] = []
    for index, info in metadata.storage_data.items():
        md = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata) or getattr(info, "transform_descriptors", None):
            return None
        if index.offset is None:
            chunk_offsets: tuple[int, ...] = (0,) * len(md.size)
            chunk_sizes: tuple[int, ...] = tuple(md.size)
        else:
            chunk_offsets = tuple(index.offset)
            chunk = next((c for c in md.chunks if tuple(c.offsets) == chunk_offsets), None)
            if chunk is None:
                return None
            chunk_sizes = tuple(chunk.sizes)
        items.append(
            TensorItem(
                fqn=index.fqn,
                file=info.relative_path,
                offset=int(info.offset),
                length=int(info.length),
                dtype=md.properties.dtype,
                chunk_offsets=chunk_offsets,
                chunk_sizes=chunk_sizes,
                full_size=tuple(md.size),
            )
        )
    return items


# ---- reading files, CRC on the way ---------------------------------------------------


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, writable, without a copy."""
    return memoryview(cast(Any, t.numpy())).cast("B")


def _by_offset(items: list[TensorItem]) -> list[TensorItem]:
    return sorted(items, key=lambda i: i.offset)


class _OrderedCrc:
    """CRC32C of one range of a file, starting at ``start``: each piece read is queued
    under its file offset and hashed in order by a helper task (``crc32c`` releases the
    GIL, so hashing overlaps the reads). Ranges read at once are hashed at once too, and
    their CRCs combined (:meth:`Crc32c.extend`)."""

    def __init__(self, pool: ThreadPoolExecutor | None, start: int = 0) -> None:
        self.crc = Crc32c()
        self._pool = pool
        self._next = start
        self._pending: dict[int, memoryview] = {}
        self._queue_lock = threading.Lock()
        self._hash_lock = threading.Lock()  # one hashing task at a time: the CRC is sequential
        self._tasks: list[Future[None]] = []

    def update(self, offset: int, view: memoryview) -> None:
        if view.nbytes == 0:
            return
        with self._queue_lock:
            self._pending[offset] = view
        if self._pool is None:
            self._drain()
        else:
            self._tasks.append(self._pool.submit(self._drain))

    def _drain(self) -> None:
        with self._hash_lock:
            while True:
                with self._queue_lock:
                    view = self._pending.pop(self._next, None)
                if view is None:
                    return
                self.crc.update(view)
                self._next += view.nbytes

    def finish(self) -> Crc32c | None:
        """The CRC32C of every byte queued, or ``None`` when a piece is missing (a hole)."""
        for task in self._tasks:
            task.result()
        self._drain()
        return None if self._pending else self.crc


class _Cursor:
    """Where one reading thread is in the file; hands each piece it reads to the CRC."""

    def __init__(self, crc: _OrderedCrc | None, offset: int) -> None:
        self.crc = crc
        self.offset = offset

    def update(self, view: memoryview) -> None:
        if self.crc is not None:
            self.crc.update(self.offset, view)
        self.offset += view.nbytes


def _open(store: Store, name: str) -> IO[bytes]:
    # A regular file only, never through a symlink (Store.open_read). Locally a buffered
    # reader: readinto larger than its buffer goes straight from the kernel into ours.
    return store.open_read(name)


def _read_into(f: IO[bytes], view: memoryview, cursor: _Cursor) -> int:
    """Fill ``view`` from ``f`` chunk by chunk, each chunk to the CRC; returns bytes read."""
    done = 0
    readinto = getattr(f, "readinto", None)
    while done < view.nbytes:
        part = view[done : done + CHUNK_BYTES]
        if readinto is not None:
            n = readinto(part) or 0
        else:  # a file object without readinto: one extra copy of this chunk
            data = f.read(part.nbytes)
            n = len(data)
            part[:n] = data
        if n == 0:
            break
        cursor.update(part[:n])
        done += n
    return done


def _ranges(items: list[TensorItem], parts: int) -> list[list[TensorItem]]:
    """``items`` (by offset) cut into at most ``parts`` runs of about equal bytes."""
    total = sum(i.length for i in items)
    runs: list[list[TensorItem]] = [[]]
    done = 0
    for item in items:
        if runs[-1] and len(runs) < parts and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(item)
        done += item.length
    return runs


def _read_range(
    store: Store,
    name: str,
    items: list[TensorItem],
    start: int,
    last: bool,
    entry: FileEntry | None,
    crc: _OrderedCrc | None,
) -> tuple[list[torch.Tensor], int, list[Exception]]:
    """Read ``items`` (a run of archives starting at file offset ``start``; the last run
    also the file's trailing bytes). Every tensor's data goes straight into a tensor of
    exactly its size (:func:`_read_archive`). Returns the tensors, the bytes read, and the
    errors of archives torch could not parse (the caller's CRC check says whether the
    bytes are damaged)."""
    tensors: list[torch.Tensor] = []
    errors: list[Exception] = []
    cursor = _Cursor(crc, start)
    with _open(store, name) as f:
        if start:
            f.seek(start)
        for item in items:
            if item.offset > cursor.offset:  # bytes between archives (none in DCP files): CRC them too
                _read_into(f, memoryview(bytearray(item.offset - cursor.offset)), cursor)
            if item.offset != cursor.offset:
                return tensors, cursor.offset - start, errors
            try:
                tensor, _ = _read_archive(f, item, cursor)
            except _Unparsable as err:  # read in full, but torch cannot parse it: the CRC decides
                errors.append(err.error)
                continue
            if tensor is None:
                return tensors, cursor.offset - start, errors
            tensors.append(tensor)
        if last:
            rest = (entry.size - cursor.offset) if entry is not None else 0
            if rest > 0:  # trailing bytes the manifest counts but no archive covers
                _read_into(f, memoryview(bytearray(rest)), cursor)
            extra = len(f.read(1))  # a file longer than the manifest says
            cursor.offset += extra
    return tensors, cursor.offset - start, errors


def _read_file(
    store: Store,
    name: str,
    items: list[TensorItem],
    entry: FileEntry | None,
    verify: bool,
    pool: ThreadPoolExecutor,
    crc_pool: ThreadPoolExecutor | None,
    parts: int,
) -> list[torch.Tensor]:
    """Read one shard file in ``parts`` ranges at once (their own file handles), checking
    its size and (``verify``) CRC32C against ``entry``."""
    runs = _ranges(items, parts)
    starts = [0] + [run[0].offset for run in runs[1:]]
    crcs = [_OrderedCrc(crc_pool, start) if verify else None for start in starts]
    try:
        futures = [
            pool.submit(_read_range, store, name, run, start, i == len(runs) - 1, entry, crcs[i])
            for i, (run, start) in enumerate(zip(runs, starts, strict=True))
        ]
        results = [f.result() for f in futures]
    except FileNotFoundError as err:
        raise CorruptCheckpointError(
            f"file {name!r} listed in the manifest is missing", path=store.url, hint=_CORRUPT_HINT
        ) from err
    tensors = [t for got, _, _ in results for t in got]
    errors = [e for _, _, errs in results for e in errs]
    sizes = [n for _, n, _ in results]
    total = sum(sizes)
    contiguous = all(n == (starts[i + 1] - starts[i]) for i, n in enumerate(sizes[:-1]))
    digest = _file_digest(crcs) if verify else None
    if not contiguous:  # a run stopped short: report the size the reads found
        total = next(
            starts[i] + n for i, n in enumerate(sizes) if i == len(sizes) - 1 or n != starts[i + 1] - starts[i]
        )
    check_entry(store, name, entry, total, digest)
    if errors:  # the bytes are as written (or unverified), yet torch cannot read them
        raise CorruptCheckpointError(
            f"file {name!r} holds a tensor record that cannot be read: {type(errors[0]).__name__}: {errors[0]}",
            path=store.url,
            hint=_CORRUPT_HINT,
        ) from errors[0]
    if len(tensors) != len(items):  # a short read, reported by check_entry unless the manifest is short too
        raise CorruptCheckpointError(f"file {name!r} ends inside a tensor", path=store.url, hint=_CORRUPT_HINT)
    return tensors


#: The head of an archive read first: torch.save's records before the tensor data
#: (data.pkl, .format_version, .storage_alignment, byteorder) take well under 1 KiB.
_HEAD_BYTES = 4096
_LOCAL_HEADER = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"


def _read_archive(f: IO[bytes], item: TensorItem, crc: _Cursor) -> tuple[torch.Tensor | None, int]:
    """Read one ``torch.save`` archive of ``item.length`` bytes from ``f``: its head into
    scratch, the tensor data straight into a new tensor of exactly the chunk's size (its
    own storage: nothing else is kept alive by it, and it saves and pickles like any
    tensor), the rest into scratch. Returns ``(tensor, bytes read)``; ``None`` for a
    short read. An archive laid out otherwise than our stager writes it is handed to
    ``torch.load(weights_only=True)`` (one copy of that tensor).
    """
    head = memoryview(bytearray(min(item.length, _HEAD_BYTES)))
    got = _read_into(f, head, crc)
    if got < head.nbytes:
        return None, got
    numel = 1
    for size in item.chunk_sizes:
        numel *= size
    nbytes = numel * item.dtype.itemsize
    start = _data_start(head)
    if start is None or sys.byteorder != "little":
        return _read_rest_and_load(f, item, head, crc)
    tensor = torch.empty(item.chunk_sizes, dtype=item.dtype)
    data = _bytes_of(tensor.view(-1).view(torch.uint8)) if nbytes else memoryview(bytearray())
    in_head = max(0, min(head.nbytes, start + nbytes) - start)
    data[:in_head] = head[start : start + in_head]
    got += _read_into(f, data[in_head:], crc)
    rest = memoryview(bytearray(max(0, item.length - max(head.nbytes, start + nbytes))))
    got += _read_into(f, rest, crc)
    if got < item.length:
        return None, got
    # The data descriptor right after the data records the record's real size.
    after = bytes(head[start + nbytes :]) + bytes(rest[:24]) if start + nbytes < head.nbytes else bytes(rest[:24])
    if not _descriptor_says(after, nbytes):
        whole = bytes(head) + bytes(data[in_head:]) + bytes(rest)  # the archive as it was in the file
        return _load_archive(whole, item), got
    return tensor, got


def _data_start(head: memoryview) -> int | None:
    """Offset of the ``*/data/0`` record's data in an archive whose first bytes are ``head``."""
    raw = bytes(head)
    pos = 0
    while (pos := raw.find(_LOCAL_HEADER, pos)) >= 0 and pos + 30 <= len(raw):
        method = int.from_bytes(raw[pos + 8 : pos + 10], "little")
        name_len = int.from_bytes(raw[pos + 26 : pos + 28], "little")
        extra_len = int.from_bytes(raw[pos + 28 : pos + 30], "little")
        name = raw[pos + 30 : pos + 30 + name_len]
        if name.endswith(b"/data/0"):
            return pos + 30 + name_len + extra_len if method == 0 else None
        pos += 30 + name_len + extra_len  # skip this header (its data follows; headers are searched for)
    return None


def _descriptor_says(after: bytes, nbytes: int) -> bool:
    """Whether the zip data descriptor in ``after`` records ``nbytes`` for the record."""
    if not after.startswith(_DESCRIPTOR):
        return False
    size32 = int.from_bytes(after[12:16], "little") if len(after) >= 16 else -1
    size64 = int.from_bytes(after[16:24], "little") if len(after) >= 24 else -1
    return nbytes in (size32, size64)


def _read_rest_and_load(
    f: IO[bytes], item: TensorItem, head: memoryview, crc: _Cursor
) -> tuple[torch.Tensor | None, int]:
    rest = memoryview(bytearray(item.length - head.nbytes))
    got = head.nbytes + _read_into(f, rest, crc)
    if got < item.length:
        return None, got
    return _load_archive(bytes(head) + bytes(rest), item), got


class _Unparsable(Exception):
    """An archive read in full that torch cannot turn into the expected tensor."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _load_archive(archive: bytes, item: TensorItem) -> torch.Tensor:
    try:
        tensor = torch.load(io.BytesIO(archive), map_location="cpu", weights_only=True)
        return tensor.reshape(item.chunk_sizes)
    except Exception as err:  # garbage bytes raise anything from the zip reader or unpickler
        raise _Unparsable(err) from err


def _file_digest(crcs: list[_OrderedCrc | None]) -> str:
    """The file's CRC32C from its ranges' (in order); ``"(a hole)"`` if a piece is missing."""
    whole: Crc32c | None = None
    for part in crcs:
        got = part.finish() if part is not None else None
        if got is None:
            return "(a hole)"
        if whole is None:
            whole = got
        else:
            whole.extend(got)
    return whole.hexdigest() if whole is not None else Crc32c().hexdigest()


def check_entry(store: Store, name: str, entry: FileEntry | None, size: int, crc: str | None) -> None:
    """Raise :class:`CorruptCheckpointError` when ``size``/``crc`` disagree with ``entry``."""
    if entry is None:
        raise CorruptCheckpointError(
            f"file {name!r} holds tensors but is not listed in the manifest", path=store.url, hint=_CORRUPT_HINT
        )
    if size != entry.size:
        raise CorruptCheckpointError(
            f"file {name!r} has {size} bytes, the manifest says {entry.size} (truncated?)",
            path=store.url,
            hint=_CORRUPT_HINT,
        )
    if crc is not None and crc != entry.crc32c:
        raise CorruptCheckpointError(
            f"file {name!r} fails its CRC32C check ({crc} != {entry.crc32c})", path=store.url, hint=_CORRUPT_HINT
        )


def read_verified_bytes(store: Store, name: str, entry: FileEntry | None, *, verify: bool) -> bytes:
    """A small file's bytes (``.metadata``, a skeleton), checked against ``entry`` in the same pass."""
    try:
        data = store.read_bytes(name)
    except FileNotFoundError as err:
        raise CorruptCheckpointError(
            f"file {name!r} listed in the manifest is missing", path=store.url, hint=_CORRUPT_HINT
        ) from err
    crc = None
    if verify:
        c = Crc32c()
        c.update(data)
        crc = c.hexdigest()
    check_entry(store, name, entry, len(data), crc)
    return data


# ---- turning archives into tensors ---------------------------------------------------


def assemble(items: list[TensorItem], chunks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors from chunks: a whole-tensor chunk is returned as is (no copy); chunks
    of a sharded tensor (FSDP) are copied into one full tensor."""
    by_fqn: dict[str, list[tuple[TensorItem, torch.Tensor]]] = {}
    for item, chunk in zip(items, chunks, strict=True):
        by_fqn.setdefault(item.fqn, []).append((item, chunk))
    out: dict[str, torch.Tensor] = {}
    for fqn, parts in by_fqn.items():
        item, chunk = parts[0]
        if len(parts) == 1 and item.chunk_sizes == item.full_size and not any(item.chunk_offsets):
            out[fqn] = chunk
            continue
        full = torch.empty(item.full_size, dtype=item.dtype)
        for part, data in parts:
            target = full
            for dim, (off, size) in enumerate(zip(part.chunk_offsets, part.chunk_sizes, strict=True)):
                target = target.narrow(dim, off, size)
            target.copy_(data)
        out[fqn] = full
    return out


def read_tensors(
    store: Store,
    items: list[TensorItem],
    files: dict[str, FileEntry],
    *,
    verify: bool = True,
    max_parallel_files: int = MAX_PARALLEL_FILES,
    progress: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``items`` as a full CPU tensor, each file read once (and verified
    against ``files`` when ``verify``). Raises :class:`CorruptCheckpointError`."""
    per_file: dict[str, list[TensorItem]] = {}
    for item in items:
        per_file.setdefault(item.file, []).append(item)
    # Largest first: the longest read starts at once. A large file is read in two ranges
    # at once (page faults on fresh memory, not the disk, bound a warm read here).
    order = sorted(per_file, key=lambda name: -sum(i.length for i in per_file[name]))
    parts = {name: 2 if sum(i.length for i in per_file[name]) >= SPLIT_BYTES else 1 for name in order}
    workers = max(1, min(max_parallel_files, sum(parts.values())))
    ordered_items: list[TensorItem] = []
    chunks: list[torch.Tensor] = []
    with (
        ThreadPoolExecutor(workers, thread_name_prefix="lp-read") as readers,
        ThreadPoolExecutor(workers, thread_name_prefix="lp-crc") as crcs,
        ThreadPoolExecutor(max(1, len(order)), thread_name_prefix="lp-file") as files_pool,
    ):
        futures = {
            name: files_pool.submit(
                _read_file,
                store,
                name,
                _by_offset(per_file[name]),
                files.get(name),
                verify,
                readers,
                crcs if verify else None,
                parts[name],
            )
            for name in order
        }
        for name, fut in futures.items():
            tensors = fut.result()
            if progress is not None:
                progress(name)
            ordered_items += _by_offset(per_file[name])
            chunks += tensors
    return assemble(ordered_items, chunks)
