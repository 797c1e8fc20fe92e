"""Making Lightning strategies save through our plugin on every rank.

Lightning's base ``Strategy.save_checkpoint`` calls the ``CheckpointIO`` on global rank
0 only, so under DDP one rank writes everything. We rebind ``save_checkpoint`` on the
strategy *instance* so every rank calls the plugin; DCP then splits the replicated
tensors so each rank writes ~1/N of the bytes, and the commit protocol needs every
rank anyway. Strategies that override ``save_checkpoint`` themselves (FSDP, DeepSpeed)
are left alone unless we know them; see docs/design.md.
"""

from __future__ import annotations

import logging
import types
from typing import Any

from lightning.pytorch.strategies import Strategy

from lightning_preempt import dist as pdist
from lightning_preempt.checkpoint_io import ShardedAsyncCheckpointIO

log = logging.getLogger(__name__)


def install_collective_saves(
    strategy: Strategy, io: ShardedAsyncCheckpointIO, writer_group: pdist.ProcessGroup | None
) -> bool:
    """Route ``strategy.save_checkpoint`` to ``io`` on all ranks. Returns whether it did."""
    if writer_group is None or pdist.world_size() == 1:
        io.enable_collective_saves(None)
        return False
    if type(strategy).save_checkpoint is not Strategy.save_checkpoint:
        log.warning(
            "lightning_preempt: %s saves checkpoints itself; rank 0 writes through the plugin alone",
            type(strategy).__name__,
        )
        io.enable_collective_saves(None)
        return False

    def save_on_every_rank(
        self: Strategy, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    strategy.save_checkpoint = types.MethodType(save_on_every_rank, strategy)  # type: ignore[method-assign]
    io.enable_collective_saves(writer_group)
    return True
