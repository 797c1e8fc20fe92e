"""Every private torch.distributed.checkpoint / torch.serialization name the package uses.

Private names move between releases; keeping them in one module makes a torch upgrade a
matter of reading one file (docs/compat.md). Checked with torch 2.7.0 (the floor) and
2.13.0 by tests/unit/test_exact_compat.py.
"""

from __future__ import annotations

import warnings

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load_state_dict
from torch.serialization import _get_layout as torch_get_layout

__all__ = [
    "DcpStorageInfo",
    "EmptyStateDictLoadPlanner",
    "FsspecFileSystem",
    "FsspecReader",
    "FsspecWriter",
    "dcp_load_state_dict",
    "torch_get_layout",
]


# ---- torch.distributed.checkpoint -------------------------------------------------------
def dcp_format_version() -> str | None:
    """The DCP format version torch writes into ``.metadata`` (``None``: a torch whose
    ``Metadata`` has no version field). Private: ``filesystem.CURRENT_DCP_VERSION``."""
    from torch.distributed.checkpoint import filesystem

    return getattr(filesystem, "CURRENT_DCP_VERSION", None)


_SINGLE_PROCESS_QUIETED = False


def quiet_single_process_warning() -> None:
    """``dcp.save``/``dcp.load`` without a process group (``no_dist``) warn on every call that
    they assume a single process: that is our intent, and the line would follow every save.
    The filter matches that message only and is added the first time we call DCP that way
    (never at import: an application that never saves alone keeps its warnings untouched)."""
    global _SINGLE_PROCESS_QUIETED
    if not _SINGLE_PROCESS_QUIETED:
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
        _SINGLE_PROCESS_QUIETED = True
