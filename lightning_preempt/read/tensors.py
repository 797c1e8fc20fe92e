"""One pass over the bytes on load (docs/resume-speed.md): each shard file read once, front to
back from the offsets DCP's ``.metadata`` gives, a large archive straight into a tensor of its
own storage, small ones in batches, every read hashed as it arrives (read/crc_reader.py); a
file whose size or CRC32C disagrees with the manifest raises :class:`CorruptCheckpointError`
before any tensor is returned. read/archive.py parses one tensor record.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format.manifest import FileEntry
from lightning_preempt.read.archive import TensorItem, Unparsable, archive_in_memory, read_archive
from lightning_preempt.read.crc_reader import Cursor, file_digest, hashing_reader, read_into
from lightning_preempt.read.verify import CORRUPT_HINT, check_entry, missing_file
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import Store

#: Ranges read at the same time, over all files.
MAX_PARALLEL_FILES = 4
#: A file at least this large is read in two ranges at once...
SPLIT_BYTES = 64 << 20
#: ...when its records average at least this size: small records are parsed in Python,
#: and two threads parsing at once mostly wait for each other (the GIL), measured slower
#: than one for 4000 records of 64 KiB.
SPLIT_MIN_RECORD_BYTES = 1 << 20

#: Archives smaller than this are read many at once (up to :data:`BATCH_BYTES` per read)
#: and copied out of that buffer; larger ones are read straight into their tensors.
SMALL_RECORD_BYTES = 1 << 20
BATCH_BYTES = 4 << 20

_HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None
_VIRTIO_DEVICES = "/sys/bus/virtio/devices"
_VIRTIO_ID_BALLOON, _VIRTIO_BALLOON_F_REPORTING = "0x0005", 5


def host_takes_back_free_memory(devices: str = _VIRTIO_DEVICES) -> bool:
    """Whether a virtio balloon with free page reporting is present: the host then takes
    back every free 2 MiB block within seconds, and touching a huge page there faults it
    in on the host too. 1 GiB into fresh memory on such a VM: 0.11-0.16 s with huge pages
    freed < 0.5 s before, 0.8-2.5 s after 1-5 s or in a fresh process; 4 KiB pages a
    steady 0.40 s (docs/resume-speed.md)."""
    try:
        names = os.listdir(devices)
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(devices, name, "device")) as f:
                if f.read().strip() != _VIRTIO_ID_BALLOON:
                    continue
            with open(os.path.join(devices, name, "features")) as f:
                bits = f.read().strip()  # one character per feature bit, bit 0 first
        except OSError:
            continue
        if bits[_VIRTIO_BALLOON_F_REPORTING : _VIRTIO_BALLOON_F_REPORTING + 1] == "1":
            return True
    return False


_advise_huge = _madvise is not None and not host_takes_back_free_memory()


def new_tensor(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty``, asking Linux for transparent huge pages when it spans some (THP
    ``madvise`` mode, the common default): the read then faults 2 MiB pages in, not 4 KiB
    ones. Not where the host takes free memory back (:func:`host_takes_back_free_memory`):
    there a fresh huge page costs 3-6x a 4 KiB page's share and varies with how long ago
    it was freed."""
    t = torch.empty(shape, dtype=dtype)
    start, end = -(-t.data_ptr() // _HUGE) * _HUGE, (t.data_ptr() + t.nbytes) // _HUGE * _HUGE
    if _advise_huge and _madvise is not None and end > start:
        _madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)  # MADV_HUGEPAGE; advisory
    return t


def destination(item: TensorItem, into: Mapping[str, torch.Tensor] | None) -> torch.Tensor | None:
    """The caller's tensor ``item`` may be read straight into (a view without autograd), or
    ``None``: only a whole, dense, contiguous CPU tensor of the item's dtype and shape."""
    t = into.get(item.fqn) if into is not None else None
    if (
        t is None
        or type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.device.type != "cpu"
        or t.dtype != item.dtype
        or tuple(t.shape) != item.chunk_sizes
        or item.chunk_sizes != item.full_size
        or any(item.chunk_offsets)
        or not t.is_contiguous()
        or t.numel() == 0
    ):
        return None
    return t.detach()


def tensor_items(metadata: Any) -> list[TensorItem] | None:
    """Every tensor chunk of ``metadata`` (a DCP ``Metadata``), or ``None`` when it holds
    anything this reader does not handle (non-tensor entries, transforms such as
    compression): the caller then takes DCP's own reader."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items: list[TensorItem] = []
    entries = metadata.state_dict_metadata
    whole: dict[int, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}  # id(md) -> (zeros, size) if one chunk
    append = items.append
    for index, info in metadata.storage_data.items():  # (thousands: kept lean)
        md = entries.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata) or getattr(info, "transform_descriptors", None):
            return None
        key = id(md)
        if key not in whole:
            size = tuple(md.size)
            chunks = md.chunks
            one = len(chunks) == 1 and not any(chunks[0].offsets) and tuple(chunks[0].sizes) == size
            whole[key] = ((0,) * len(size), size) if one else None
        full = whole[key]
        if full is not None and (index.offset is None or not any(index.offset)):
            chunk_offsets, chunk_sizes = full  # the common case: a tensor saved whole
            full_size = chunk_sizes
        elif index.offset is None:
            full_size = tuple(md.size)
            chunk_offsets, chunk_sizes = (0,) * len(full_size), full_size
        else:
            full_size = tuple(md.size)
            chunk_offsets = tuple(index.offset)
            chunk = next((c for c in md.chunks if tuple(c.offsets) == chunk_offsets), None)
            if chunk is None:
                return None
            chunk_sizes = tuple(chunk.sizes)
        item = TensorItem(index.fqn, info.relative_path, int(info.offset), int(info.length), md.properties.dtype,
                          chunk_offsets, chunk_sizes, full_size)  # fmt: skip
        append(item)
    return items


# ---- reading files, CRC on the way ---------------------------------------------------
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


def _small_run(items: list[TensorItem], i: int) -> int:
    """How many archives from ``items[i]`` on are small, back to back, and fit in one
    :data:`BATCH_BYTES` read (1 when ``items[i]`` is read on its own)."""
    first = items[i]
    end = first.offset
    n = 0
    for item in items[i:]:
        if item.length >= SMALL_RECORD_BYTES or item.offset != end or end + item.length - first.offset > BATCH_BYTES:
            break
        end += item.length
        n += 1
    return max(n, 1)


def _read_range(
    store: Store,
    name: str,
    items: list[TensorItem],
    start: int,
    end: int | None,
    entry: FileEntry | None,
    crc: Crc32c | None,
    outs: list[torch.Tensor],
) -> tuple[list[torch.Tensor], int, list[Exception]]:
    """Read ``items``, a run of archives from file offset ``start`` (to ``end``; ``None``: the
    last run, with the file's trailing bytes), each into its tensor in ``outs``. Returns the
    tensors, the bytes read, and the errors of archives torch could not parse (the caller's CRC
    check says whether the bytes are damaged)."""
    tensors: list[torch.Tensor] = []
    errors: list[Exception] = []
    cursor = Cursor(start)  # offsets only: hashing_reader hashes what storage returns
    # A regular file only, never through a symlink (Store.open_read).
    with store.open_read(name) as raw:
        if start:
            raw.seek(start)
        f = hashing_reader(raw, crc, start, end)
        scratch: memoryview | None = None
        layouts: dict[tuple[int, int], int] = {}  # archive_in_memory's per-file memo
        i = 0
        while i < len(items):
            item = items[i]
            if item.offset > cursor.offset:  # bytes between archives (none in DCP files): CRC them too
                read_into(f, memoryview(bytearray(item.offset - cursor.offset)), cursor)
            if item.offset != cursor.offset:
                return tensors, cursor.offset - start, errors
            batch = _small_run(items, i)
            if batch > 1:  # back-to-back small archives: one read into scratch, parsed from memory
                run = items[i : i + batch]
                total = run[-1].offset + run[-1].length - item.offset
                scratch = scratch if scratch is not None else memoryview(bytearray(BATCH_BYTES))
                if read_into(f, scratch[:total], cursor) < total:
                    return tensors, cursor.offset - start, errors
                for j, one in enumerate(run, i):
                    rel = one.offset - item.offset
                    try:
                        tensors.append(archive_in_memory(scratch[rel : rel + one.length], one, layouts, outs[j]))
                    except Unparsable as err:  # read in full, but torch cannot parse it: the CRC decides
                        errors.append(err.error)
                i += batch
                continue
            i += 1
            try:
                tensor, _ = read_archive(f, item, cursor, outs[i - 1])
            except Unparsable as err:  # read in full, but torch cannot parse it: the CRC decides
                errors.append(err.error)
                continue
            if tensor is None:
                return tensors, cursor.offset - start, errors
            tensors.append(tensor)
        if end is None:
            rest = (entry.size - cursor.offset) if entry is not None else 0
            if rest > 0:  # trailing bytes the manifest counts but no archive covers
                read_into(f, memoryview(bytearray(rest)), cursor)
            extra = len(f.read(1))  # a file longer than the manifest says
            cursor.offset += extra
    return tensors, cursor.offset - start, errors


def _read_file(
    store: Store,
    name: str,
    items: list[TensorItem],
    entry: FileEntry | None,
    verify: bool,
    pool: ThreadPoolExecutor | None,
    parts: int,
    into: Mapping[str, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Read one shard file in ``parts`` ranges at once (their own file handles; ``pool``: none,
    one range read on this thread), checking its size and (``verify``) CRC32C against
    ``entry``; into ``into``'s tensors where they fit."""
    runs = _ranges(items, parts)
    # Every tensor allocated here, on the file's thread, as torch.load does; the readers
    # fill them (and fault their pages in, in parallel when there are several ranges).
    outs = [[_out(item, into) for item in run] for run in runs]
    starts = [0] + [run[0].offset for run in runs[1:]]
    ends: list[int | None] = [*starts[1:], None]  # the last range reads to the end of the file
    crcs = [Crc32c() for _ in starts]  # each range's, hashed by its reader when verifying
    try:
        if pool is None:
            results = [_read_range(store, name, runs[0], 0, None, entry, crcs[0] if verify else None, outs[0])]
        else:
            futures = [
                pool.submit(_read_range, store, name, run, start, ends[i], entry, crcs[i] if verify else None, outs[i])
                for i, (run, start) in enumerate(zip(runs, starts, strict=True))
            ]
            results = [f.result() for f in futures]
    except FileNotFoundError as err:
        raise missing_file(name, store) from err
    tensors = [t for got, _, _ in results for t in got]
    errors = [e for _, _, errs in results for e in errs]
    sizes = [n for _, n, _ in results]
    # the size the reads found: where the first run that stopped short (or the last) ended
    total = next(starts[i] + n for i, n in enumerate(sizes) if i == len(sizes) - 1 or n != starts[i + 1] - starts[i])
    check_entry(store, name, entry, total, file_digest(crcs) if verify else None)
    if errors:  # the bytes are as written (or unverified), yet torch cannot read them
        raise CorruptCheckpointError(
            f"file {name!r} holds a tensor record that cannot be read: {type(errors[0]).__name__}: {errors[0]}",
            path=store.url,
            hint=CORRUPT_HINT,
        ) from errors[0]
    if len(tensors) != len(items):  # a short read, reported by check_entry unless the manifest is short too
        raise CorruptCheckpointError(f"file {name!r} ends inside a tensor", path=store.url, hint=CORRUPT_HINT)
    return tensors


def _out(item: TensorItem, into: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    given = destination(item, into)
    return given if given is not None else new_tensor(item.chunk_sizes, item.dtype)


def read_verified_bytes(store: Store, name: str, entry: FileEntry | None, *, verify: bool) -> bytes:
    """A small file's bytes (``.metadata``, a skeleton), checked against ``entry`` in the same pass."""
    try:
        data = store.read_bytes(name)
    except FileNotFoundError as err:
        raise missing_file(name, store) from err
    check_entry(store, name, entry, len(data), Crc32c(data).hexdigest() if verify else None)
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
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``items`` as a full CPU tensor, each file read once (and verified
    against ``files`` when ``verify``). Raises :class:`CorruptCheckpointError`.

    ``into``: tensors by key (e.g. the model's parameters) that a whole tensor of the same
    dtype and shape is read straight into, with no tensor of its own and no later copy; the
    result then holds that very tensor. Written *during* the read: only for bytes that need
    no verdict after it (a sealed tier-0 copy, read/seal.py), since a short or unreadable
    file is found only once some of them were written."""
    per_file: dict[str, list[TensorItem]] = {}
    for item in sorted(items, key=lambda i: i.offset):
        per_file.setdefault(item.file, []).append(item)
    # Largest first: the longest read starts at once. A large file is read in two ranges
    # at once (page faults on fresh memory, not the disk, bound a warm read here).
    total = {name: sum(i.length for i in items) for name, items in per_file.items()}
    order = sorted(per_file, key=lambda name: -total[name])
    parts = {n: 1 + (total[n] >= max(SPLIT_BYTES, SPLIT_MIN_RECORD_BYTES * len(per_file[n]))) for n in order}
    workers = max(1, min(MAX_PARALLEL_FILES, sum(parts.values())))
    ordered_items: list[TensorItem] = []
    chunks: list[torch.Tensor] = []
    if sum(parts.values()) == 1:  # one range in all (a single process's checkpoint): read on this thread,
        # nothing to overlap (a reader thread measured slower and bimodal: docs/resume-speed.md)
        ordered_items = per_file[order[0]]
        chunks = _read_file(store, order[0], ordered_items, files.get(order[0]), verify, None, 1, into)
    else:
        with (
            ThreadPoolExecutor(workers, thread_name_prefix="lp-read") as readers,
            ThreadPoolExecutor(max(1, len(order)), thread_name_prefix="lp-file") as files_pool,
        ):
            futures = {
                name: files_pool.submit(
                    _read_file, store, name, per_file[name], files.get(name), verify, readers, parts[name], into
                )
                for name in order
            }
            for name, fut in futures.items():
                chunks += fut.result()
                ordered_items += per_file[name]
    out = assemble(ordered_items, chunks)
    for key, tensor in (into or {}).items():  # read into the caller's tensor: return that one itself
        got = out.get(key)
        if got is not None and got is not tensor and got.data_ptr() == tensor.data_ptr() and got.shape == tensor.shape:
            out[key] = tensor
    return out
