"""Exact resume for a Fabric loop: where the loop is in its data, and the RNG states.

The driver of ``resume/`` for the one loader :class:`~lightning_preempt.fabric.Preemption`
iterates, as ``lightning/exact.py`` is for the Trainer. It owns that loader's epoch and batch
counter, makes the epoch's iterator itself (so ``set_epoch`` gets the real epoch) and moves
batches to Fabric's device. Restores follow loaders.py's call order, resharding at a resize.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from lightning_preempt.lightning import _compat
from lightning_preempt.resume import ddp_buckets, exact_state
from lightning_preempt.resume.loaders import ResumableLoaders
from lightning_preempt.resume.samplers import is_stateful

log = logging.getLogger(__name__)

REPLAY_SETTING = "Preemption(...).data.loaders.replay_setting"


class LoopData:
    """The epoch, the batch counter and the resume of the loader a loop iterates."""

    def __init__(self) -> None:
        self.loaders = ResumableLoaders(replay_setting=REPLAY_SETTING)
        self.epoch = 0
        self.batches_in_epoch = 0
        self.restored: str | None = None  # "mid-epoch", "resharded", "epoch-end", "derived" (tests and logs)
        self._loader: Any = None
        self._pending: dict[str, Any] | None = None

    # -- saving --
    def capture(self, *, rank: int, world_size: int, step: int, model: object = None) -> dict[str, Any]:
        """This rank's state at a step boundary (nothing is drawn between it and the save);
        ``model``: the loop's DDP module, whose gradient-bucket layout is saved with it."""
        dl = self._loader
        loaders = [dl] if dl is not None else []
        state = exact_state.make_state(
            rank=rank, world_size=world_size, epoch=self.epoch, global_step=step,
            batches_in_epoch=self.batches_in_epoch, loaders=self.loaders.capture(loaders, self.epoch, self.batches_in_epoch) if loaders else [],
            metrics={}, results={}, ddp_buckets=ddp_buckets.capture(model),
        )  # fmt: skip
        state["loader_states"] = [dl.state_dict() if is_stateful(dl) else None for dl in loaders]
        return state

    # -- loading --
    def load(self, state: dict[str, Any] | None) -> None:
        """Keep a loaded state until the loop's next :meth:`iterate`."""
        self._pending = exact_state.checked(state)
        if self._pending is not None:
            self.epoch = int(self._pending["epoch"])
            self.batches_in_epoch = int(self._pending["batches_in_epoch"])

    @property
    def ddp_layout(self) -> ddp_buckets.Layout | None:
        """The DDP bucket layout of the loaded state (``None``: none saved, or nothing loaded)."""
        return None if self._pending is None else ddp_buckets.clean(self._pending.get("ddp_buckets"))

    def iterate(
        self, loader: Any, *, to_device: Callable[[Any], Any], max_epochs: int, rank: int, world_size: int,
        boundary: Callable[[], None],
    ) -> Iterator[Any]:  # fmt: skip
        """Batches of ``loader`` for epochs ``self.epoch`` … ``max_epochs - 1``, resumed where
        the loaded state left off; ``boundary()`` after the loop's work on each batch."""
        dl, device = _compat.fabric_loader_parts(loader)
        if not self.loaders.is_current([dl]):
            self.loaders.wrap([dl])
        self._loader = dl
        try:
            n = float(len(dl))
        except TypeError:  # no length: a saved epoch never counts as ended
            n = float("inf")
        state, self._pending = self._pending, None
        resharded = False
        if state is not None:
            exact_state.warn_world_size(state, world_size)
            # Another split of the saved epoch first (this rank's share of the rest of it, when it
            # was split among another number of ranks, or already resharded): this rank's batch count
            # may be past the epoch's length at a larger world size while the world has not consumed it all.
            done = int(state["batches_in_epoch"])
            resharded = state.get("epoch") == self.epoch and done > 0 and bool(
                self.loaders.reshard([dl], state.get("loaders", []), self.epoch, done))  # fmt: skip
            if not resharded and state["batches_in_epoch"] >= n:  # the save ended its epoch: the next one starts
                self.epoch, self.batches_in_epoch = int(state["epoch"]) + 1, 0
        while self.epoch < max_epochs:
            iterator = self._start_epoch(dl, state, n, rank, resharded)
            state, resharded = None, False
            for batch in iterator:
                yield to_device(batch) if device is not None else batch
                self.batches_in_epoch += 1
                boundary()
            self.epoch += 1
            self.batches_in_epoch = 0

    # -- internals --
    def _start_epoch(
        self, dl: Any, state: dict[str, Any] | None, n: float, rank: int, resharded: bool = False
    ) -> Iterator[Any]:
        epoch = self.epoch
        mid_epoch = exact_state.is_mid_epoch(state, epoch, n)
        if state is None:
            _compat.set_sampler_epoch(dl, epoch)  # a ResumableSampler notes the states its order comes from
            self.loaders.note_epoch_start([dl], epoch)
            self.batches_in_epoch = 0
            return iter(dl)
        saved = state.get("loaders", [])
        own = state.get("rank") == rank
        if resharded:
            # The rest of the epoch's order, split among the ranks of now (its ReshardedSampler,
            # put back by the next epoch's set_epoch); the batch counter goes on from the save.
            if own:  # workers draw their base seed from the epoch start's states, as when it began
                self.loaders.set_pre_iter_rng([dl], saved)
            self.loaders.remake_resharded([dl], {0}, None)  # a StatefulDataLoader starts afresh from its share
        elif mid_epoch:
            self.loaders.restore_positions(saved, True, self.batches_in_epoch)
            loader_states = state.get("loader_states") or [None]
            if is_stateful(dl) and loader_states[0] is not None:
                dl.load_state_dict(loader_states[0])
            if own:
                self.loaders.set_pre_iter_rng([dl], saved)
        else:  # the save ended an epoch: the next epoch's iterator is made from the save's states
            self._restore_rng(state, rank)
            self.batches_in_epoch = 0
        _compat.set_sampler_epoch(dl, epoch)
        self.loaders.note_pre_iter([dl], epoch)
        iterator = iter(dl)
        if resharded or mid_epoch:  # the iterator is made from the epoch start's states, then the save's
            self._restore_rng(state, rank)
        kind = "resharded" if resharded else "mid-epoch" if mid_epoch else "epoch-end"
        self.restored = kind if own or resharded else "derived"
        log.info("lightning_preempt: exact resume (%s) at epoch %d, batch %d of the epoch", self.restored, epoch,
                 self.batches_in_epoch)  # fmt: skip
        return iterator

    def _restore_rng(self, state: dict[str, Any], rank: int) -> None:
        if not self.loaders.restore_states([self._loader], state, rank):  # (set by iterate before any epoch)
            self.restored = "derived"
