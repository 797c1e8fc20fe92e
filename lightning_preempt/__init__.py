"""lightning_preempt: make PyTorch Lightning training survive preemption.

Public API::

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, list_checkpoints
"""

import logging as _logging

# Like Lightning does for its own logger: show our INFO lines (resume, commits, the
# preemption timeline) unless the application configured logging itself.
_log = _logging.getLogger(__name__)
if not _log.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(_logging.INFO)
    _log.propagate = False

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

del _logging

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
