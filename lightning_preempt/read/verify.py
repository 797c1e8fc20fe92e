"""Checking a checkpoint against its manifest: the manifest itself, every file's presence,
size and CRC32C. Needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from lightning_preempt.errors import CorruptCheckpointError, NotACheckpointError
from lightning_preempt.format.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest, data_store, parse_manifest
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.storage import local
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import CHUNK_BYTES, Store, not_regular


def read_manifest(store: Store) -> Manifest:
    """The committed manifest of ``store``; raises :class:`NotACheckpointError` without one."""
    try:
        # a regular file, not through a symlink, size-capped: a FIFO or /dev/zero named
        # manifest.json must neither hang nor exhaust memory (docs/security.md)
        data = store.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except FileNotFoundError as err:
        raise NotACheckpointError(
            "no committed checkpoint here: manifest.json is missing",
            path=store.url,
            hint="A directory without a manifest is a partial (uncommitted) save. Pass the path of a "
            "committed checkpoint, or its parent directory to take the newest valid one.",
        ) from err
    return parse_manifest(data, path=store.url)  # schema and file names checked


def verify_checkpoint(
    store: Store,
    manifest: Manifest | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    share: tuple[int, int] = (0, 1),
) -> Manifest:
    """Every listed file exists with its size and CRC32C; ``progress(bytes read so far)``.
    ``share=(rank, world)``: only every ``world``-th file from ``rank`` (in name order)."""
    manifest = manifest or read_manifest(store)
    files = data_store(store, manifest)  # a replaced checkpoint's files live in its generation dir
    for name, entry in sorted(manifest.files.items())[share[0] :: share[1]]:
        crc = Crc32c()
        try:
            with files.open_read(name) as f:
                while crc.nbytes <= entry.size and (chunk := f.read(CHUNK_BYTES)):  # stop past the size
                    crc.update(chunk)
                    if progress is not None:
                        progress(len(chunk))
        except FileNotFoundError as err:
            raise missing_file(name, store) from err
        check_entry(store, name, entry, crc.nbytes, crc.hexdigest())
    return manifest


CORRUPT_HINT = "This checkpoint is damaged; resume from an older one (auto-resume skips it)."


def missing_file(name: str, store: Store) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"file {name!r} listed in the manifest is missing", path=store.url, hint=CORRUPT_HINT)


def check_entry(store: Store, name: str, entry: FileEntry | None, size: int, crc: str | None) -> None:
    """Raise :class:`CorruptCheckpointError` when ``size``/``crc`` disagree with ``entry``."""
    if entry is None:
        problem = "holds tensors but is not listed in the manifest"
    elif size != entry.size:
        problem = f"has {size} bytes, the manifest says {entry.size} (truncated?)"
    elif crc is not None and crc != entry.crc32c:
        problem = f"fails its CRC32C check ({crc} != {entry.crc32c})"
    else:
        return
    raise CorruptCheckpointError(f"file {name!r} {problem}", path=store.url, hint=CORRUPT_HINT)


#: How much a candidate is checked before it is chosen (catalog/newest.py).
Verify = bool | Literal["sizes"]

#: ``fallback(excluded)``: the next checkpoint to try, or ``None`` (catalog/newest.py).
Fallback = Callable[[list[str]], "str | None"]


def check_sizes(store: Store, manifest: Manifest | None = None) -> Manifest:
    """Every listed file exists with its size: one listing, no data read (a flipped bit is
    the load's to catch)."""
    manifest = manifest or read_manifest(store)
    store = data_store(store, manifest)  # a replaced checkpoint's files live in its generation dir
    sizes = {e.name: e.size for e in store.entries()}
    for name, entry in sorted(manifest.files.items()):
        if name not in sizes:
            raise missing_file(name, store)
        size = sizes[name]
        check_entry(store, name, entry, int(size if size is not None else _size(store, name)), None)
    return manifest


def _size(store: Store, name: str) -> int:
    """The size of ``name`` when the listing lacked it (a local symlink, some object stores)."""
    entry = store.stat(name)
    if entry is None:
        raise FileNotFoundError(store.url_of(name))
    return entry.size if entry.size is not None else int(store.info(name).get("size", 0))


def check_checkpoint(store: Store, manifest: Manifest | None = None, *, verify: Verify = True) -> Manifest:
    """:func:`verify_checkpoint` (``True``), :func:`check_sizes` (``"sizes"``) or only the manifest."""
    if verify == "sizes":
        return check_sizes(store, manifest)
    if verify:
        return verify_checkpoint(store, manifest)
    return manifest or read_manifest(store)


def check_files(store: Store, manifest: Manifest) -> None:
    """Without verification, still insist (cheaply, no data read) that every listed file
    is a regular file of its size, not a symlink, FIFO or device (local disk)."""
    for name, entry in sorted(manifest.files.items()):
        try:
            check_regular(store, name, entry.size)
        except FileNotFoundError as err:
            raise missing_file(name, store) from err


def check_regular(store: Store, name: str, size: int) -> None:
    """Locally, without reading data: ``name`` is a regular file of ``size`` bytes."""
    if not store.is_local:
        return
    try:
        actual = local.regular_size(store.path(name))
    except local.NotRegularFileError as err:
        raise not_regular(store, name, err.what) from None
    check_entry(store, name, FileEntry(size, ""), actual, None)  # the size only

