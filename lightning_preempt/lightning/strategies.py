"""Lightning strategies saving and loading through our plugin on every rank (docs/strategies.md).

* DDP, a single device, and any strategy with the base ``Strategy.save_checkpoint`` (which calls
  the plugin on rank 0 only): ``save_checkpoint`` rebound on the instance, so every rank writes ~1/N.
* ``ModelParallelStrategy`` (FSDP2) and ``FSDPStrategy`` (FSDP1), which bypass ``CheckpointIO``:
  every rank gives its sharded state dict to the plugin, and ours load in place, resharded
  (lightning/sharded_saves.py).
* ``DeepSpeedStrategy``: DeepSpeed's own per-rank files, committed by our manifest
  (lightning/deepspeed.py).
* Any other strategy that saves by itself (XLA, a user's ``save_checkpoint``): refused at set-up
  on every rank with a HINT. Its saves would bypass the plugin: no manifest, no commit, and a
  requeued job would start from step 0.

* ``DDPStrategy`` at 2+ ranks: ``_setup_model`` builds DDP with the gradient bucket layout
  of the checkpoint being resumed (resume/ddp_buckets.py), so the first step reduces as the
  uninterrupted run did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy

from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine.config import PreemptionConfig, Tuning
from lightning_preempt.lightning import _compat, sharded_saves
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.resume import ddp_buckets

log = logging.getLogger(__name__)

#: The :class:`~lightning_preempt.Tuning` fields the plugin reads when it is made.
PLUGIN_TUNING = ("thread_count", "pinned_memory_budget", "overlap_staging")


def ensure_plugin(
    strategy: Any, config: PreemptionConfig, *, user: str = "PreemptionCallback", host: str = "the Trainer",
) -> ShardedAsyncCheckpointIO:  # fmt: skip
    """The strategy's :class:`ShardedAsyncCheckpointIO`, given ``config``'s ``storage_options``
    and ``local_dirpath`` (:func:`hand_options`); installed, with ``config``'s tuning too, when the
    strategy has Lightning's default plugin (a Trainer's or a Fabric's: ``user`` and ``host``
    name them in the messages). Another plugin is refused with a HINT."""
    io = strategy.checkpoint_io
    if isinstance(io, ShardedAsyncCheckpointIO):
        return hand_options(io, config)
    if type(io) is TorchCheckpointIO:
        log.info("lightning_preempt: installing ShardedAsyncCheckpointIO on %s's strategy (none was configured)", host)
        strategy.checkpoint_io = ShardedAsyncCheckpointIO(tuning=config.tuning)
        return hand_options(strategy.checkpoint_io, config)
    raise TypeError(
        f"{user} needs ShardedAsyncCheckpointIO, but {host} uses {type(io).__name__}\n"
        f"HINT: pass plugins=[ShardedAsyncCheckpointIO()] to {host} (and remove other CheckpointIO plugins)."
    )


def hand_options(io: ShardedAsyncCheckpointIO, config: PreemptionConfig) -> ShardedAsyncCheckpointIO:
    """Give ``io`` the front-end's ``storage_options`` and ``local_dirpath`` (their one owner);
    a plugin's own different local tier is refused later, with a HINT (engine/tier_policy.py)."""
    io.use_storage_options(config.storage_options)
    unread = [f"{k}={getattr(config, k)!r}" for k in PLUGIN_TUNING
              if getattr(config, k) not in (getattr(Tuning, k), getattr(io.config, k))]  # fmt: skip
    if unread:
        log.warning("lightning_preempt: the callback's tuning (%s) does not reach the ShardedAsyncCheckpointIO you "
                    "passed, which reads its own\nHINT: pass ShardedAsyncCheckpointIO(tuning=...), or leave the plugin "
                    "out: the callback installs it with its tuning.", ", ".join(unread))  # fmt: skip
    if config.local_dirpath is not None and io.saver.tiers is None:
        io.saver.use_local_tier(config.local_dirpath, retries=config.retries, backoff_s=config.backoff_s)
    return io


def install_collective_saves(
    strategy: Strategy, io: ShardedAsyncCheckpointIO, writer_group: pdist.ProcessGroup | None
) -> None:
    """Route ``strategy``'s saves (and sharded loads) through ``io`` on all ranks; a strategy
    that saves by itself in a way we cannot route is refused (every rank raises the same)."""
    if isinstance(strategy, FSDPStrategy):
        sharded_saves.install_fsdp(strategy, io)
    elif isinstance(strategy, ModelParallelStrategy):
        sharded_saves.install_model_parallel(strategy, io)
    elif isinstance(strategy, DeepSpeedStrategy):
        from lightning_preempt.lightning import deepspeed  # its glue, only where DeepSpeed is used

        deepspeed.install(strategy, io)
    elif type(strategy).save_checkpoint is not Strategy.save_checkpoint:
        raise TypeError(
            f"lightning_preempt does not support {type(strategy).__name__}: it saves checkpoints with its own "
            "code, which bypasses ShardedAsyncCheckpointIO (no manifest, no commit: a requeued job would "
            "start from step 0)\nHINT: use strategy='ddp', 'fsdp', 'deepspeed', ModelParallelStrategy or a single device "
            "(docs/strategies.md); a strategy of your own must not override save_checkpoint."
        )
    elif writer_group is None or pdist.world_size() == 1:
        writer_group = None
    else:
        _compat.rebind(strategy, "every_rank_saves", save_checkpoint=_save_on_every_rank)
    io.enable_collective_saves(writer_group)


def give_ddp_bucket_layout(strategy: Strategy, saved: Callable[[], ddp_buckets.Layout | None]) -> None:
    """Under DDP at 2+ ranks, build the DDP module with rank 0's ``saved()`` bucket layout
    (called when the strategy wraps the model, after the checkpoint is loaded). A no-op for
    other strategies, one rank, and a strategy that makes its DDP module its own way."""
    if getattr(strategy, "world_size", 1) < 2:
        return

    def build(self: Any, make: Callable[[], Any]) -> Any:
        # Every rank the same layout, or DDP's ranks would reduce mismatched buckets: rank 0's.
        layout = ddp_buckets.clean(self.broadcast(saved() if self.global_rank == 0 else None))
        return ddp_buckets.build(make, layout)

    _compat.build_ddp_through(strategy, build)


def _save_on_every_rank(self: Strategy, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
    self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
