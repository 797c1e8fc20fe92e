"""Run Lightning's own checkpointing tests with ShardedAsyncCheckpointIO in every Trainer.

Copied next to Lightning's ``tests_pytorch`` folder (see README.md). Every ``Trainer`` gets
``ShardedAsyncCheckpointIO(trust_checkpoints=True)`` unless the test gives a CheckpointIO
itself; ``LP_INJECT=0`` turns the injection off (the baseline run).
"""

import os
import sys
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import Trainer

sys.path.insert(0, os.path.dirname(__file__))
INJECT = os.environ.get("LP_INJECT", "1") == "1"
# The legacy-checkpoint tests need archives Lightning's CI downloads (not in git) and scikit-learn.
collect_ignore = ["tests_pytorch/checkpointing/test_legacy_checkpoints.py"]
_original_init = Trainer.__init__


def _init(self: Trainer, *args: Any, **kwargs: Any) -> None:
    if INJECT:
        from lightning_preempt import ShardedAsyncCheckpointIO

        plugins = kwargs.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(ShardedAsyncCheckpointIO(trust_checkpoints=True))
        kwargs["plugins"] = plugins
    _original_init(self, *args, **kwargs)


Trainer.__init__ = _init  # type: ignore[method-assign]
