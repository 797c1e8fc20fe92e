"""lightning_preempt: make PyTorch Lightning training survive preemption.

Public API::

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, list_checkpoints
"""

from lightning_preempt import _logsetup  # noqa: F401  (first: handler for our INFO lines)
from lightning_preempt.callback import Preempted, PreemptionCallback
from lightning_preempt.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.discovery import CheckpointInfo, list_checkpoints, newest_valid
from lightning_preempt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedFormatError,
)
from lightning_preempt.reader import verify_checkpoint

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "NotACheckpointError",
    "Preempted",
    "PreemptionCallback",
    "ShardedAsyncCheckpointIO",
    "UnsupportedFormatError",
    "list_checkpoints",
    "newest_valid",
    "verify_checkpoint",
]
