"""``Preemption``: a hand-written Fabric loop mapped onto the engine (engine/engine.py).

The policy is the engine's, as for ``PreemptionCallback``, with the same options
(:class:`~lightning_preempt.engine.config.PreemptionConfig`, :class:`~lightning_preempt.Tuning`). Fabric's part stays here: the
plugin on its strategy, ``fabric.save``/``fabric.load`` of ``state``, the data position.
The map onto the engine's calls: docs/fabric.md, "Errors and exits".
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine import deprecated as deprecated_names
from lightning_preempt.engine.config import PreemptionConfig, Tuning, own_fields
from lightning_preempt.engine.engine import Engine
from lightning_preempt.fabric import sharded
from lightning_preempt.fabric.data import LoopData
from lightning_preempt.lightning import _compat
from lightning_preempt.lightning.callback import EngineViews
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.lightning.logs import SaveReporter
from lightning_preempt.lightning.strategies import ensure_plugin
from lightning_preempt.resume import ddp_buckets
from lightning_preempt.resume.exact_state import STATE_KEY
from lightning_preempt.save.order import SaveOrder

log = logging.getLogger(__name__)

#: Keys the front-end adds to every ``fabric.save`` state besides :data:`STATE_KEY`.
STEP_KEY, EPOCH_KEY = "global_step", "epoch"


class Preemption(EngineViews):
    """Periodic async checkpoints, a snapshot on preemption, and resume, for a Fabric loop.

    ::

        fabric = L.Fabric(devices=2, strategy="ddp", plugins=[ShardedAsyncCheckpointIO()])
        fabric.launch()
        preempt = Preemption(fabric, dirpath="gs://bucket/run", every_n_train_steps=500)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        preempt.resume(state)              # the newest valid checkpoint, agreed by every rank
        for batch in preempt.iterate(loader, state):
            ...                            # forward, backward, optimizer.step(); state["step"] += 1
        preempt.finish(state)

    On a signal (or a cloud notice with ``on_notice="exit"``) on any rank, every rank saves
    the same step, waits for its commit and raises :class:`~lightning_preempt.Preempted`
    (a ``SystemExit`` with ``exit_code``, 143), requeueing under SLURM first.

    Args:
        fabric: the launched ``Fabric``; its strategy gets :class:`ShardedAsyncCheckpointIO`
            when it has Lightning's default ``CheckpointIO``.
        dirpath: where checkpoints go.
        step_key: the key of ``state`` that counts optimizer steps (the loop increments it).
        tuning: :class:`~lightning_preempt.Tuning` (``global_batch`` is validated, but a
            Fabric loop owns its accumulation; ``log_metrics`` logs through ``fabric.log_dict``).
        options: :class:`~lightning_preempt.PreemptionCallback`'s other options, by keyword:
            the fields of :class:`~lightning_preempt.engine.config.PreemptionConfig`
            (docs/options.md).
    """

    def __init__(
        self, fabric: Any, dirpath: str, *, step_key: str = "step", tuning: Tuning | None = None, **options: Any
    ) -> None:
        old = deprecated_names.callback_names(
            **{k: options.pop(k) for k in list(options) if k not in own_fields(PreemptionConfig)}
        )
        config = deprecated_names.front("Preemption", {"dirpath": dirpath, **options}, tuning, old)
        if not isinstance(step_key, str) or not step_key:
            raise ValueError(f"step_key must be a non-empty string, got {step_key!r}\nHINT: e.g. step_key='step'.")
        self.fabric = fabric
        self.step_key = step_key
        self.engine = Engine(config)
        self.data = LoopData()
        self._state: dict[str, Any] | None = None
        self._io: ShardedAsyncCheckpointIO | None = None
        self._reporter = SaveReporter(self.engine)

    # ---- views (and EngineViews') -------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch :meth:`iterate` is in (restored by :meth:`resume`)."""
        return self.data.epoch

    # ---- 1.-3. set-up and resume ---------------------------------------------------------
    def resume(self, state: dict[str, Any]) -> dict[str, Any]:
        """Every rank, after ``fabric.setup`` and before the first step (collective).

        Sets the engine up (groups, the lease, the storage probe, the agreed resume choice),
        loads the newest valid checkpoint in ``dirpath`` into ``state`` in place (modules,
        optimizers, plain values; ``fabric.load``'s contract) and restores the RNG states
        and the data position. A fresh start loads nothing. Returns what the checkpoint held
        beyond ``state`` (``fabric.load``'s remainder), ``{}`` when nothing was loaded.
        """
        fabric = self.fabric
        io = self._io = _ensure_plugin(fabric.strategy, self.config)
        sharded.check(fabric.strategy, state)  # FSDP1 without a device mesh: refused before step 1
        self._state = state
        _compat.tolerate_preempted_children(self.config.exit_code, self.config.grace_period_s)
        self.engine.peek()  # remembered; agreed in setup
        target = self.engine.setup(
            io.saver, save=self._save, leader=fabric.is_global_zero, local_rank=fabric.local_rank,
            route_saves=lambda group: io.enable_collective_saves(group if pdist.world_size() > 1 else None),
            verify_on_load=io.config.verify_on_load,
        )  # fmt: skip
        remainder: dict[str, Any] = {}
        if target is not None:
            io.alias(target.path, target.path, fallback=target.fallback)  # damage: every rank falls back together
            part = _saved_part(state)
            remainder = fabric.load(target.path, part)
            state.update(part)  # fabric.load put the plain values into the dict it was given
            self.data.load(remainder.pop(STATE_KEY, None))
            self._give_bucket_layout(state)
            remainder.pop(STEP_KEY, None)
            remainder.pop(EPOCH_KEY, None)
        step = self._current(state)[1]
        self.engine.start(step, loaded_from=io.loaded_from if target is not None else None)
        if target is not None and self.config.log_metrics and fabric.is_global_zero:
            fabric.log_dict({"preempt/resumed_from_step": float(step)}, step=step)
        return remainder

    # ---- 4. step boundaries ----------------------------------------------------------------
    def iterate(self, loader: Any, state: dict[str, Any] | None = None, *, max_epochs: int = 1) -> Iterator[Any]:
        """The batches of ``loader`` (a plain, stateful or Fabric-set-up ``DataLoader``) up to
        ``max_epochs`` epochs, from where the resumed checkpoint left off; after the loop's
        work on each batch (when it asks for the next one, and after the last) a step
        boundary (:meth:`step`). An exception leaving the loop releases the engine."""
        if state is not None:
            self._state = state
        fabric = self.fabric
        try:
            yield from self.data.iterate(
                loader, to_device=fabric.to_device, max_epochs=max_epochs, rank=fabric.global_rank,
                world_size=fabric.world_size, boundary=self.step,
            )  # fmt: skip
        except GeneratorExit:
            raise  # the loop stopped early (break): nothing went wrong
        except BaseException:
            self.close(finish_saves=True)
            raise

    def step(self, state: dict[str, Any] | None = None) -> None:
        """Every rank, after each batch's work (optimizer step included): a periodic save,
        or the emergency sequence (raises :class:`~lightning_preempt.Preempted`), or an
        agreed stop. Mid gradient accumulation (``state[step_key]`` unchanged) it does nothing."""
        self._report()
        self.engine.step_end(self._current(state)[1])

    # ---- 5./6. the end -----------------------------------------------------------------------
    def finish(self, state: dict[str, Any] | None = None) -> None:
        """Every rank, when training ends normally: the final save, every commit (and with two
        tiers every upload to ``dirpath``) waited for, then the engine released."""
        self.engine.finish(self._current(state)[1])
        if self._io is not None and self._io.tiers is not None:
            # Fabric never tears the plugin down (the Trainer does): without this the last
            # checkpoint's upload to dirpath could still be running when the process exits.
            self._io.tiers.wait()
        self._report()
        self.close()

    def close(self, *, finish_saves: bool = False) -> None:
        """Every rank: stop the sources, release the lease and the groups (``finish_saves``:
        after an exception, finish the pending saves first). Later ``fabric.save`` calls make
        their own writer group."""
        self.engine.close(finish_saves=finish_saves)
        if self._io is not None:
            self._io.enable_collective_saves(None)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        if err is not None:
            self.close(finish_saves=True)

    # ---- internals ------------------------------------------------------------------------------
    def _give_bucket_layout(self, state: dict[str, Any]) -> None:
        """A DDP loop's first resumed backward reduces in the saved run's rebuilt buckets
        (resume/ddp_buckets.py): ``fabric.setup`` built DDP before this load, so its reducer is
        made again with the layout rank 0 loaded (broadcast: the same on every rank)."""
        ddp = _ddp_of(state)
        if ddp is None or self.fabric.world_size < 2:
            return
        layout = ddp_buckets.clean(self.fabric.broadcast(self.data.ddp_layout if self.fabric.is_global_zero else None))
        ddp_buckets.rebuild(ddp, layout)

    def _report(self) -> None:
        """The saves committed since the last boundary, through ``fabric.log_dict`` (rank 0;
        no collective: the history is this rank's plugin's)."""
        if not self.config.log_metrics or self._io is None:
            return
        for metrics, step in self._reporter.collect(self._io.history, is_global_zero=self.fabric.is_global_zero):
            self.fabric.log_dict(metrics, step=step)

    def _save(self, order: SaveOrder) -> None:
        """The engine's save: ``fabric.save`` of the loop's state (every rank), ``order`` handed
        to the strategy as its ``storage_options`` (docs/design.md "A save, hop by hop")."""
        state, step = self._current()
        fabric = self.fabric
        saved = _saved_part(state)
        saved[STATE_KEY] = self.data.capture(
            rank=fabric.global_rank, world_size=fabric.world_size, step=step, model=_ddp_of(state)
        )
        saved[STEP_KEY], saved[EPOCH_KEY] = step, self.data.epoch
        _compat.fabric_save(fabric, saved, order)

    def _current(self, state: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
        """The loop's state (``state``, kept for later calls, else the one given before) and its step."""
        if state is not None:
            self._state = state
        if self._state is None:
            raise RuntimeError(
                "lightning_preempt: Preemption has no training state yet\n"
                "HINT: call preempt.resume(state) once before the loop (every rank)."
            )
        step = self._state.get(self.step_key)
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(
                f"lightning_preempt: state[{self.step_key!r}] must be the int count of optimizer steps, got {step!r}\n"
                f"HINT: keep state[{self.step_key!r}] = 0 in the state and add 1 after every optimizer step "
                "(or pass step_key= the key your loop counts in)."
            )
        return self._state, step


def _saved_part(state: dict[str, Any]) -> dict[str, Any]:
    """What ``fabric.save`` gets of the loop's state: all but data loaders (their position is
    saved by fabric/data.py; a loader object is no checkpoint content)."""
    return {k: v for k, v in state.items() if not isinstance(v, DataLoader) and type(v).__name__ != "_FabricDataLoader"}


def _ensure_plugin(strategy: Strategy, config: PreemptionConfig) -> ShardedAsyncCheckpointIO:
    """The strategy's :class:`ShardedAsyncCheckpointIO`; installed when it has Lightning's
    default ``CheckpointIO``. Another plugin is refused with a HINT. ``ModelParallelStrategy``
    and ``FSDPStrategy`` write DCP shards with no commit (the first refuses a ``CheckpointIO``):
    they get one of their own, routed by fabric/sharded.py."""
    if isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):
        return sharded.own_plugin(strategy, config)
    if type(strategy).save_checkpoint is not Strategy.save_checkpoint:
        # DeepSpeed, XLA, a user's own: they write with their own code, no manifest, no commit
        raise TypeError(
            f"Preemption does not support Fabric's {type(strategy).__name__}: it saves checkpoints with its own "
            "code, which no manifest commits\nHINT: use strategy='ddp' (or 'ddp_spawn', 'ddp_fork', "
            "'ddp_notebook', a single device), 'fsdp' or ModelParallelStrategy; see docs/fabric.md."
        )
    return ensure_plugin(strategy, config, user="Preemption", host="Fabric")


def _ddp_of(state: dict[str, Any]) -> DistributedDataParallel | None:
    """The DDP module of the loop's state (inside Fabric's wrapper), if there is exactly one."""
    modules = (getattr(v, "_forward_module", v) for v in state.values())
    found = [m for m in modules if isinstance(m, DistributedDataParallel)]
    return found[0] if len(found) == 1 else None
