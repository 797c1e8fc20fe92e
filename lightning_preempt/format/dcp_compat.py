"""Every private torch.distributed.checkpoint / torch.serialization name the package uses, so a
torch upgrade means reading one file (docs/compat.md; torch 2.7.0-2.13.0).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type as split_by_size
from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict as _dcp_save_state_dict
from torch.serialization import _get_layout as torch_get_layout

__all__ = [
    "DcpStorageInfo",
    "EmptyStateDictLoadPlanner",
    "FsspecFileSystem",
    "FsspecReader",
    "FsspecWriter",
    "dcp_load_state_dict",
    "dcp_save_tensors",
    "split_by_size",
    "torch_get_layout",
]


# ---- torch.distributed.checkpoint -------------------------------------------------------
def dcp_save_tensors(
    tensors: dict[str, Any], *, storage_writer: Any, planner: Any, process_group: Any, no_dist: bool
) -> Any:
    """``dcp.save`` of a flat tensor dict without its per-entry ``Stateful`` pass (~80 us per
    tensor; tensors are never ``Stateful``). Private: ``state_dict_saver._save_state_dict``."""
    import torch.distributed as dist

    no_dist = no_dist or not (dist.is_available() and dist.is_initialized())
    if no_dist:
        quiet_single_process_warning()
    return _dcp_save_state_dict(
        state_dict=dict(tensors),
        storage_writer=storage_writer,
        process_group=process_group,
        no_dist=no_dist,
        planner=planner,
    )


def cached_plan(key: str, kind: str) -> Any:
    """What ``DefaultSavePlanner(enable_plan_caching=True)`` holds under ``key`` (the planner's
    ``_cached_plans_key``) in its class-level dict ``_cached_{kind}``: ``save_plan`` (this rank's
    local plan), ``all_plans`` (the coordinator's of every rank). Private, since torch 2.6."""
    return getattr(SavePlanner, f"_cached_{kind}", {}).get(key)


def forget_cached_plans(key: str) -> None:
    """Drop everything DCP's plan caching holds under ``key`` (:func:`cached_plan`)."""
    for kind in ("save_plan", "final_save_plan", "all_plans", "global_plan", "metadata"):
        getattr(SavePlanner, f"_cached_{kind}", {}).pop(key, None)


def dcp_format_version() -> str | None:
    """The DCP format version torch writes into ``.metadata`` (``None``: a torch whose
    ``Metadata`` has no version field). Private: ``filesystem.CURRENT_DCP_VERSION``."""
    from torch.distributed.checkpoint import filesystem

    return getattr(filesystem, "CURRENT_DCP_VERSION", None)


@functools.cache
def quiet_single_process_warning() -> None:
    """Silence DCP's per-call "assuming a single process" warning under ``no_dist`` (our intent);
    added once, on first use, never at import, and for that message only."""
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
