"""DCP's reader for our shard files; ``.metadata`` goes through the restricted unpickler.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.pickles.unpickle import read_dcp_metadata
from lightning_preempt.storage.store import Store


class _CheckedReader(_compat.FsspecReader):
    """DCP's reader for the shards of a checkpoint directory, with ``.metadata`` read through
    ``read_dcp_metadata``: a restricted unpickler and a check that it names only tensors in
    our shard files (``manifest``: the files it may refer to)."""

    def __init__(self, store: Store, manifest: Manifest | None) -> None:
        super().__init__(store.url, **store.storage_options)
        # the Store's own filesystem (its options: e.g. plain gcsfs against an emulator)
        self.fs.fs = store.dcp_filesystem()  # type: ignore[attr-defined]
        self._store = store
        self._manifest = manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(self._store, self._manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata  # type: ignore[no-any-return]


def load_all_tensors(store: Store, *, manifest: Manifest | None = None) -> dict[str, Any]:
    """Every tensor of the shards, unsharded, on CPU, in this process alone (no template:
    the empty-state-dict planner, as DCP's ``dcp_to_torch_save`` does)."""
    tensors: dict[str, Any] = {}
    _compat.dcp_load_state_dict(
        tensors, storage_reader=_CheckedReader(store, manifest), planner=_compat.EmptyStateDictLoadPlanner(), no_dist=True
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
    if not distributed:
        _compat.quiet_single_process_warning()
    dcp.load(tensors, storage_reader=_CheckedReader(store, manifest), process_group=process_group, no_dist=not distributed)

