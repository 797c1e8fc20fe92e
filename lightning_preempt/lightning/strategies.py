"""Lightning strategies saving and loading through our plugin on every rank (docs/design.md).

* DDP and any strategy with the base ``Strategy.save_checkpoint`` (which calls the plugin on
  rank 0 only): ``save_checkpoint`` rebound on the instance, so every rank writes ~1/N.
* ``ModelParallelStrategy`` (bypasses ``CheckpointIO``, no commit): ``save_checkpoint`` gives
  its sharded state dict to the plugin, ``load_checkpoint`` loads ours in place, resharded.

* ``DeepSpeedStrategy``: DeepSpeed's own per-rank files, committed by our manifest
  (lightning/deepspeed.py).

Other strategies that save by themselves (FSDP1) are left alone with a warning.

* ``DDPStrategy`` at 2+ ranks: ``_setup_model`` builds DDP with the gradient bucket layout
  of the checkpoint being resumed (resume/ddp_buckets.py), so the first step reduces as the
  uninterrupted run did.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, Strategy

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.format.skeleton import split_checkpoint
from lightning_preempt.lightning import _compat
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.resume import ddp_buckets

log = logging.getLogger(__name__)


def ensure_plugin(
    strategy: Any, storage_options: dict[str, Any], local_dirpath: str | None,
    *, user: str = "PreemptionCallback", host: str = "the Trainer",
) -> ShardedAsyncCheckpointIO:  # fmt: skip
    """The strategy's :class:`ShardedAsyncCheckpointIO`; installed (with these options) when
    it has Lightning's default plugin (a Trainer's or a Fabric's strategy: ``user`` and
    ``host`` name them in the messages). Another plugin is refused with a HINT."""
    io = strategy.checkpoint_io
    if isinstance(io, ShardedAsyncCheckpointIO):
        return io
    if type(io) is TorchCheckpointIO:
        log.info("lightning_preempt: installing ShardedAsyncCheckpointIO on %s's strategy (none was configured)", host)
        new_io = ShardedAsyncCheckpointIO(storage_options=storage_options, local_dirpath=local_dirpath)
        strategy.checkpoint_io = new_io
        return new_io
    raise TypeError(
        f"{user} needs ShardedAsyncCheckpointIO, but {host} uses {type(io).__name__}\n"
        f"HINT: pass plugins=[ShardedAsyncCheckpointIO()] to {host} (and remove other CheckpointIO plugins)."
    )


def install_collective_saves(
    strategy: Strategy, io: ShardedAsyncCheckpointIO, writer_group: pdist.ProcessGroup | None
) -> None:
    """Route ``strategy``'s saves (and sharded loads) through ``io`` on all ranks, where it can."""
    if isinstance(strategy, ModelParallelStrategy):
        _install_model_parallel(strategy, io)
    elif isinstance(strategy, DeepSpeedStrategy):
        from lightning_preempt.lightning import deepspeed  # its glue, only where DeepSpeed is used

        deepspeed.install(strategy, io)
    elif writer_group is None or pdist.world_size() == 1:
        writer_group = None
    elif type(strategy).save_checkpoint is not Strategy.save_checkpoint:
        log.warning(
            "lightning_preempt: %s saves checkpoints itself; rank 0 writes through the plugin alone",
            type(strategy).__name__,
        )
        writer_group = None
    else:
        strategy.save_checkpoint = types.MethodType(_save_on_every_rank, strategy)  # type: ignore[method-assign]
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


def _install_model_parallel(strategy: ModelParallelStrategy, io: ShardedAsyncCheckpointIO) -> None:
    original_save = strategy.save_checkpoint
    original_load = strategy.load_checkpoint

    def save(
        self: ModelParallelStrategy, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            original_save(checkpoint, filepath, storage_options)  # full state on rank 0: Lightning's path
            return
        io.save_checkpoint(checkpoint, str(self.broadcast(str(filepath))), storage_options=storage_options)

    def load(self: ModelParallelStrategy, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = self.broadcast(str(checkpoint_path))
        # One rank looks at storage and decides; the rest get its answer or its error.
        resolved = agree.decide(lambda: io.resolve(path), pdist.world_group(), what="resolving the checkpoint")
        if resolved is None:
            return original_load(checkpoint_path, weights_only)  # type: ignore[no-any-return]
        model = self.model
        assert model is not None
        templates = {
            "state_dict": get_model_state_dict(model),
            "optimizer_states": [get_optimizer_state_dict(model, opt) for opt in self.optimizers],
        }
        flat, _ = split_checkpoint(templates)
        checkpoint = io.load_sharded(resolved, flat)
        assert self.lightning_module is not None
        model.load_state_dict(checkpoint["state_dict"], strict=self.lightning_module.strict_loading)
        options = StateDictOptions(cpu_offload=True)
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            set_optimizer_state_dict(model, opt, optim_state_dict=state, options=options)
        return checkpoint

    strategy.save_checkpoint = types.MethodType(save, strategy)  # type: ignore[method-assign]
    strategy.load_checkpoint = types.MethodType(load, strategy)  # type: ignore[method-assign]
