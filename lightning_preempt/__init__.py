"""lightning_preempt: make PyTorch Lightning training survive preemption.

Public API::

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning, list_checkpoints

Names are imported on first use (PEP 562), so the CLI does not import Lightning to read
manifests. The folders are layers (docs/design.md; import-linter keeps them); ``torchrun``,
``elastic`` and ``notices`` stand outside them because users type their paths.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any


def _show_our_info_lines() -> None:
    """Our INFO lines (resume, commits, the preemption timeline) shown by default, as Lightning
    does for its own logger: when neither the root logger nor ours has a handler, ours gets a
    plain stream handler at INFO. ``propagate`` is left alone, so an application that configures
    logging later still receives our records (and may remove the handler)."""
    log = logging.getLogger("lightning_preempt")
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


_show_our_info_lines()

if TYPE_CHECKING:
    from lightning_preempt.catalog.listing import CheckpointInfo, list_checkpoints
    from lightning_preempt.catalog.newest import newest_valid
    from lightning_preempt.engine.config import Tuning
    from lightning_preempt.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CheckpointWriteError,
        CorruptCheckpointError,
        NotACheckpointError,
        ProgressWouldBeLostError,
        UnsupportedFormatError,
        UntrustedCheckpointError,
    )
    from lightning_preempt.lightning.callback import PreemptionCallback
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
    from lightning_preempt.lightning.peer_replica import PeerReplica
    from lightning_preempt.preemption.controller import Preempted
    from lightning_preempt.read.verify import verify_checkpoint

__version__ = "0.2.0"  # the one place: pyproject.toml reads it, CHANGELOG.md names it (tests/unit/test_release.py)

_WHERE = {
    "Preempted": "preemption.controller",
    "PreemptionCallback": "lightning.callback",
    "ShardedAsyncCheckpointIO": "lightning.checkpoint_io",
    "PeerReplica": "lightning.peer_replica",
    "Tuning": "engine.config",
    "CheckpointInfo": "catalog.listing",
    "list_checkpoints": "catalog.listing",
    "newest_valid": "catalog.newest",
    "verify_checkpoint": "read.verify",
    "CheckpointError": "errors",
    "ProgressWouldBeLostError": "errors",
    "CheckpointExistsError": "errors",
    "CheckpointNotFoundError": "errors",
    "CheckpointWriteError": "errors",
    "CorruptCheckpointError": "errors",
    "NotACheckpointError": "errors",
    "UnsupportedFormatError": "errors",
    "UntrustedCheckpointError": "errors",
}

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "NotACheckpointError",
    "PeerReplica",
    "Preempted",
    "PreemptionCallback",
    "ProgressWouldBeLostError",
    "ShardedAsyncCheckpointIO",
    "Tuning",
    "UnsupportedFormatError",
    "UntrustedCheckpointError",
    "list_checkpoints",
    "newest_valid",
    "verify_checkpoint",
]
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_preempt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_preempt.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
