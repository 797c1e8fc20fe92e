"""Run Lightning's own checkpointing tests with ShardedAsyncCheckpointIO in every Trainer and Fabric.

Copied next to Lightning's ``tests_pytorch`` / ``tests_fabric`` folders (see README.md). Every
``Trainer`` gets ``ShardedAsyncCheckpointIO(trust_checkpoints=True)`` unless the test gives a
CheckpointIO itself. Every Fabric strategy (so every ``Fabric``, and strategies the tests build
directly) gets one where Lightning would make its default ``TorchCheckpointIO``: a strategy given
a CheckpointIO keeps it, and the strategies that refuse any CheckpointIO (Fabric's FSDP,
ModelParallel, XLA, DeepSpeed) stay as they are. ``LP_INJECT=0`` turns the injection off (the
baseline run).
"""

import contextlib
import os
import sys
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.strategies.strategy import Strategy as FabricStrategy
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


def _fabric_checkpoint_io(self: FabricStrategy) -> CheckpointIO:
    # Lightning's own getter makes a TorchCheckpointIO when none was given (strategy.py)
    if self._checkpoint_io is None:
        from lightning_preempt import ShardedAsyncCheckpointIO

        self._checkpoint_io = ShardedAsyncCheckpointIO(trust_checkpoints=True)
    return self._checkpoint_io


_original_fabric_init = Fabric.__init__


def _fabric_init(self: Fabric, *args: Any, **kwargs: Any) -> None:
    _original_fabric_init(self, *args, **kwargs)
    # Make the plugin now, in this process: ddp_spawn pickles the strategy into workers that
    # never import this conftest (a Trainer's plugin is made in __init__ the same way).
    with contextlib.suppress(NotImplementedError):  # FSDP, ModelParallel refuse every CheckpointIO
        self._strategy.checkpoint_io  # noqa: B018


if INJECT:
    FabricStrategy.checkpoint_io = property(_fabric_checkpoint_io, FabricStrategy.checkpoint_io.fset)  # type: ignore[method-assign]
    Fabric.__init__ = _fabric_init  # type: ignore[method-assign]
