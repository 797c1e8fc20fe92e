"""Reading one checkpoint directory: manifest, verification, and the Lightning dict."""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Callable
from typing import Any

import torch

from lightning_preempt.checksum import Crc32c
from lightning_preempt.commit import STATE_FILE
from lightning_preempt.dcp_storage import DCP_METADATA_NAME, load_all_tensors, load_tensors_into
from lightning_preempt.errors import CorruptCheckpointError, NotACheckpointError
from lightning_preempt.fastload import read_tensors, read_verified_bytes, tensor_items
from lightning_preempt.format import merge_checkpoint, tensor_refs
from lightning_preempt.manifest import MANIFEST_NAME, Manifest
from lightning_preempt.storage import Store

log = logging.getLogger(__name__)

_CHUNK = 8 << 20


def read_manifest(store: Store) -> Manifest:
    """The committed manifest of ``store``; raises :class:`NotACheckpointError` without one."""
    try:
        data = store.read_bytes(MANIFEST_NAME)
    except FileNotFoundError as err:
        raise NotACheckpointError(
            "no committed checkpoint here: manifest.json is missing",
            path=store.url,
            hint="A directory without a manifest is a partial (uncommitted) save. Pass the path of a "
            "committed checkpoint, or its parent directory to take the newest valid one.",
        ) from err
    return Manifest.from_json(data, path=store.url)


def verify_checkpoint(
    store: Store, manifest: Manifest | None = None, *, progress: Callable[[int], None] | None = None
) -> Manifest:
    """Check that every file the manifest lists exists with its size and CRC32C.

    ``progress`` is called with the bytes read so far (for progress bars).
    """
    manifest = manifest or read_manifest(store)
    for name, entry in sorted(manifest.files.items()):
        crc = Crc32c()
        try:
            with store.open_read(name) as f:
                while chunk := f.read(_CHUNK):
                    crc.update(chunk)
                    if progress is not None:
                        progress(len(chunk))
        except FileNotFoundError as err:
            raise CorruptCheckpointError(
                f"file {name!r} listed in the manifest is missing", path=store.url, hint=_CORRUPT_HINT
            ) from err
        if crc.nbytes != entry.size:
            raise CorruptCheckpointError(
                f"file {name!r} has {crc.nbytes} bytes, the manifest says {entry.size} (truncated?)",
                path=store.url,
                hint=_CORRUPT_HINT,
            )
        if crc.hexdigest() != entry.crc32c:
            raise CorruptCheckpointError(
                f"file {name!r} fails its CRC32C check ({crc.hexdigest()} != {entry.crc32c})",
                path=store.url,
                hint=_CORRUPT_HINT,
            )
    return manifest


_CORRUPT_HINT = "This checkpoint is damaged; resume from an older one (auto-resume skips it)."


def load_skeleton(store: Store, manifest: Manifest, rank: int, *, verify: bool = False) -> Any:
    """The non-tensor state saved by ``rank`` (rank 0's when this rank did not exist then).

    ``verify``: check its size and CRC32C against the manifest in the same read.
    """
    name = STATE_FILE.format(rank=rank)
    if name not in manifest.files:
        name = STATE_FILE.format(rank=0)
    data = read_verified_bytes(store, name, manifest.files.get(name), verify=verify)
    # The skeleton holds arbitrary Lightning state (hparams, callback state): like a
    # Lightning .ckpt it needs full unpickling; its bytes were CRC-checked above.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def load_sharded_checkpoint(
    store: Store,
    templates: dict[str, Any],
    *,
    rank: int,
    verify: bool = True,
    process_group: Any = None,
) -> dict[str, Any]:
    """Load into ``templates`` (flat ``{key: tensor | DTensor}``, as :func:`split_checkpoint`
    makes them from the *current* model and optimizers) in place, resharding to the current
    world size, and return the Lightning checkpoint dict around them.

    Collective: every rank of ``process_group`` calls it.
    """
    manifest = verify_checkpoint(store) if verify else read_manifest(store)
    skeleton = load_skeleton(store, manifest, rank)
    missing = set(templates) - set(tensor_refs(skeleton))
    if missing:
        raise CorruptCheckpointError(
            f"the model has {len(missing)} tensors that the checkpoint lacks (e.g. {sorted(missing)[0]!r})",
            path=store.url,
            hint="Resume with the model and optimizers that wrote this checkpoint.",
        )
    load_tensors_into(store, templates, process_group=process_group)
    loaded = dict(templates)
    result = merge_checkpoint(skeleton, _FallbackDict(loaded))
    assert isinstance(result, dict)
    return result


class _FallbackDict(dict):  # type: ignore[type-arg]
    """Refs the model did not ask for (e.g. dropped parameters) resolve to ``None``."""

    def __missing__(self, key: str) -> None:
        return None


def load_full_checkpoint(store: Store, *, rank: int = 0, verify: bool = True) -> dict[str, Any]:
    """The complete Lightning checkpoint dict, with full (unsharded) CPU tensors.

    One pass over the bytes (:mod:`lightning_preempt.fastload`): every file this rank
    reads (its skeleton, ``.metadata``, the shards) is checked against the manifest's
    size and CRC32C while it is read; files it does not read (other ranks' skeletons)
    are not. Raises :class:`CorruptCheckpointError` on any mismatch, before returning
    anything: the caller can fall back to an older checkpoint.
    """
    manifest = read_manifest(store)
    skeleton = load_skeleton(store, manifest, rank, verify=verify)
    keys = set(tensor_refs(skeleton))
    tensors: dict[str, Any] = {}
    if keys:
        tensors = _load_all_tensors_verified(store, manifest, verify=verify)
    missing = keys - set(tensors)
    if missing:
        raise CorruptCheckpointError(
            f"{len(missing)} tensors referenced by the state are not in the shards (e.g. {sorted(missing)[0]!r})",
            path=store.url,
            hint=_CORRUPT_HINT,
        )
    result = merge_checkpoint(skeleton, tensors)
    assert isinstance(result, dict)
    return result


def _load_all_tensors_verified(store: Store, manifest: Manifest, *, verify: bool) -> dict[str, Any]:
    """Every tensor of the shards, each shard file read once (CRC32C on the way)."""
    data = read_verified_bytes(store, DCP_METADATA_NAME, manifest.files.get(DCP_METADATA_NAME), verify=verify)
    items = tensor_items(_dcp_metadata_from_bytes(data))
    if items is None:  # not a layout the one-pass reader knows: DCP's reader, verified first
        if verify:
            verify_checkpoint(store, manifest)
        return load_all_tensors(store)
    return read_tensors(store, items, manifest.files, verify=verify)


def _dcp_metadata_from_bytes(data: bytes) -> Any:
    """DCP's ``.metadata`` (a pickled ``Metadata``), as ``FsspecReader.read_metadata`` reads it."""
    return pickle.loads(data)  # the same trust as DCP's own reader; CRC-checked above
