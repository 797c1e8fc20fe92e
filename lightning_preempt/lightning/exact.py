"""Exact resume for the Trainer (docs/exact-resume.md): RNG states and the loaders' generators,
a plain ``DataLoader``'s position, ``torchmetrics`` states and ``self.log``'s aggregates.

:class:`ExactResume` drives ``resume/``: it captures the state at a save (each rank's skeleton
file) and restores it at ``on_train_start``, the last hook before a resumed run's first fetch.
What stays here is Lightning's: the fit loop's loaders and counters, ``set_epoch``, the hooks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, cast

import lightning.pytorch as pl

from lightning_preempt.lightning import _compat
from lightning_preempt.resume import ddp_buckets, exact_state
from lightning_preempt.resume.exact_state import STATE_KEY, cpu_copy, metric_states, restore_rng
from lightning_preempt.resume.loaders import ResumableLoaders, drop_replayed

log = logging.getLogger(__name__)

__all__ = ["STATE_KEY", "ExactResume", "merge_result_states", "result_states"]


def result_states(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    """Running ``on_epoch`` aggregates of tensors logged with ``self.log`` during training."""
    results = _compat.training_results(trainer)
    out: dict[str, dict[str, Any]] = {}
    if results is None:
        return out
    for key, rm in results.items():
        if getattr(rm, "is_tensor", False) and rm.meta.on_epoch and not rm.has_reset:
            entry = {"value": cpu_copy(rm.value)}
            if hasattr(rm, "cumulated_batch_size"):
                entry["cumulated_batch_size"] = cpu_copy(rm.cumulated_batch_size)
            out[key] = entry
    return out


def merge_result_states(trainer: pl.Trainer, pending: dict[str, dict[str, Any]]) -> None:
    """Fold saved aggregates into the entries logged since the resume (removes them from ``pending``).

    The entries were created fresh by the first ``self.log`` after the resume, so they
    hold that batch alone; sums and max/min commute, so ``saved + new`` is bitwise what
    the uninterrupted run computed.
    """
    results = _compat.training_results(trainer)
    if results is None:
        return
    for key in [k for k in pending if k in results]:
        rm, saved = results[key], pending.pop(key)
        value = saved["value"].to(rm.value.device, rm.value.dtype)
        if rm.meta.is_max_reduction or rm.meta.is_min_reduction:
            rm.value = rm.meta.reduce_fx(rm.value, value)
        else:
            rm.value = rm.value + value
        if "cumulated_batch_size" in saved and hasattr(rm, "cumulated_batch_size"):
            cumulated = rm.cumulated_batch_size
            rm.cumulated_batch_size = cumulated + saved["cumulated_batch_size"].to(cumulated.device)


def _batches_done(trainer: pl.Trainer) -> int:
    """Batches of the current epoch trained so far (Lightning's counter; types say less)."""
    return int(cast(Any, trainer.fit_loop.epoch_loop.batch_progress.current).processed)


def _sampler_epoch_setter(trainer: pl.Trainer) -> Callable[[Any], None]:
    """Sets a loader's sampler epoch as Lightning is about to (its count of epochs finished)."""
    epoch = cast(Any, trainer.fit_loop.epoch_progress.current).processed
    return lambda loader: _compat.set_sampler_epoch(loader, epoch)


def _iterator_maker(trainer: pl.Trainer) -> Callable[[], object] | None:
    """``iter(fetcher)``: remakes every training loader's iterator (``None``: no fetcher yet)."""
    fetcher = _compat.train_fetcher(trainer)
    return None if fetcher is None else lambda: iter(fetcher)


# ---- the orchestration used by PreemptionCallback ----------------------------------------
class ExactResume:
    """Captures and restores what an exact resume needs; driven by :class:`PreemptionCallback`.

    :attr:`enabled` ``False`` turns it off (samplers left alone, nothing extra saved). With
    :attr:`replay_worker_draws` a mid-epoch resume has the workers load the trained batches
    again (and drops them), so random draws inside workers match an uninterrupted run bit for
    bit, at the cost of reading that part of the epoch again (docs/exact-resume.md).
    """

    def __init__(self, enabled: bool = True, replay_worker_draws: bool = False, global_batch: str = "per_rank") -> None:
        self.enabled = enabled
        self.replay_worker_draws = replay_worker_draws
        self.global_batch = global_batch  # at a resize: "per_rank" or "keep" (PreemptionCallback's option)
        self._resharded = False  # this process's first epoch goes on from a split among another number of ranks
        self._loaded: dict[str, Any] | None = None
        self._loaders = ResumableLoaders(replay_setting="PreemptionCallback(...).exact.replay_worker_draws")
        self._warned_stale = False
        self._pending_results: dict[str, dict[str, Any]] = {}
        self.restored: str | None = None  # "mid-epoch", "epoch-end", "derived" (for tests and logs)
        # This rank's own mid-epoch state, saved by as many ranks, put every training loader
        # back at its saved position and order: Lightning's "dataloader is not resumable"
        # warning is then untrue (callback.py hides it for this resume).
        self.positions_restored = False

    # -- saving --
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:  # fmt: skip
        """Add this rank's state to ``checkpoint`` (a top-level key: it stays in the rank's skeleton)."""
        if not self.enabled or not trainer.training:
            return
        checkpoint[STATE_KEY] = self.capture(trainer, pl_module)
        if _batches_done(trainer) >= trainer.num_training_batches:
            # Saved after the epoch's last batch: a StatefulDataLoader's state says "exhausted";
            # Lightning then resumes into an empty epoch and counts one epoch too many. Without
            # it the next epoch starts afresh, exactly as in the uninterrupted run.
            loop_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
            if loop_state.pop("combined_loader", None) is not None:
                log.debug("lightning_preempt: dropped the exhausted data loader state of an epoch-end save")

    def capture(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """This rank's state at the moment of the save (call from ``on_save_checkpoint``)."""
        batches = _batches_done(trainer)
        loaders = _compat.train_loaders(trainer)
        if not self._loaders.is_current(loaders) and not self._warned_stale:
            self._warned_stale = True
            log.warning("lightning_preempt: the training loaders were replaced without on_train_epoch_start being "
                        "called; a mid-epoch resume from this checkpoint keeps the position but not the data order")  # fmt: skip
        return exact_state.make_state(
            rank=trainer.global_rank, world_size=trainer.world_size, epoch=trainer.current_epoch,
            global_step=trainer.global_step, batches_in_epoch=batches,
            loaders=self._loaders.capture(loaders, trainer.current_epoch, batches), metrics=metric_states(pl_module),
            results=result_states(trainer), accumulate=trainer.accumulate_grad_batches,
            ddp_buckets=ddp_buckets.capture(trainer.strategy.model),
        )  # fmt: skip

    # -- loading --
    def load(self, state: dict[str, Any] | None) -> None:
        """Keep the saved state until :meth:`on_train_start` applies it."""
        if not self.enabled:
            return
        self._loaded = exact_state.checked(state)

    def ddp_layout(self) -> ddp_buckets.Layout | None:
        """The loaded state's DDP bucket layout (``None`` without one): DDP is built after the load."""
        return None if self._loaded is None else ddp_buckets.clean(self._loaded.get("ddp_buckets"))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wrap the training samplers, then restore the saved state (last, just before data is fetched)."""
        self.positions_restored = False
        if not self.enabled:
            return
        state, self._loaded = self._loaded, None
        # Lightning goes on inside the saved epoch unless the save ended it (then it starts the next).
        mid_epoch = exact_state.is_mid_epoch(state, trainer.current_epoch, trainer.num_training_batches)
        own = state is not None and state.get("rank") == trainer.global_rank
        # A resume from a save that ended an epoch reloads the loaders (when they are reloaded
        # every n epochs) at the next epoch start, after this hook and without calling
        # on_train_epoch_start. We reload them here instead, so that the loaders we wrap and
        # restore are those that train: after restoring the RNG (the epoch-end branch below)
        # as the uninterrupted run did, else now.
        reload_due = _compat.train_reload_due(trainer)
        reload_after_restore = reload_due and own and not mid_epoch
        if reload_due and not reload_after_restore:
            _compat.reload_train_data(trainer)
        self._wrap(trainer)
        if state is None:
            self._remake_iterators(trainer)
            return
        exact_state.warn_world_size(state, trainer.world_size)
        trainer.accumulate_grad_batches = exact_state.accumulation_at(state, trainer.world_size,
                                                                      trainer.accumulate_grad_batches, self.global_batch)  # fmt: skip
        saved = state.get("loaders", [])
        loaders = _compat.train_loaders(trainer)
        resharded: set[int] = set()
        if state.get("epoch") == trainer.current_epoch and state["batches_in_epoch"] > 0:
            # Another split of the saved epoch: mid-epoch even where this rank's batches are
            # past the epoch's length at this world size (it counts what other worlds trained).
            resharded = self._loaders.reshard(loaders, saved, trainer.current_epoch, state["batches_in_epoch"])
            mid_epoch = mid_epoch or bool(resharded)
        batches = state["batches_in_epoch"] if mid_epoch else 0
        exact_positions = self._loaders.restore_positions(saved, mid_epoch, batches, resharded)
        if mid_epoch:
            exact_state.restore_metrics(pl_module, state)
            self._pending_results = dict(state.get("results", {}))
        if resharded:
            # Another split of the epoch: every loader starts afresh from its share (this
            # rank's own pre-iter states, so workers draw as at the epoch start where it can).
            if own:
                self._loaders.set_pre_iter_rng(loaders, saved)
            _compat.refresh_train_batches(trainer)  # the epoch's length per rank changed
            self._loaders.remake_resharded(loaders, resharded, _iterator_maker(trainer))
            self._resharded = True
            self._loaders.restore_states(loaders, state, trainer.global_rank)
            self.restored = "resharded"
        elif own and mid_epoch:
            # Remake the iterators from the RNG states this epoch's iterators were made from
            # (the workers get the same base seed), let the workers replay what they loaded
            # (replay_worker_draws), then restore the states of the moment of the save.
            self._loaders.set_pre_iter_rng(_compat.train_loaders(trainer), saved)
            replay = self._remake_iterators(trainer, mid_epoch=True)
            self._drop_replayed(trainer, replay)
            self._loaders.restore_states(_compat.train_loaders(trainer), state, trainer.global_rank)
            self.restored = "mid-epoch"
            self.positions_restored = exact_positions and state.get("world_size") == trainer.world_size
        elif own:
            # The save ended an epoch: the uninterrupted run made the next epoch's iterators
            # (reloading the loaders first, if due) after this point, from these states.
            restore_rng(state["rng"])
            if reload_after_restore:
                _compat.reload_train_data(trainer)
                self._wrap(trainer)  # new loaders: their generators are as train_dataloader() made them
            else:
                self._loaders.restore_generators(_compat.train_loaders(trainer), saved)
            self._loaders.make_next_epoch_iterators(_compat.train_loaders(trainer), trainer.current_epoch,
                                                    _iterator_maker(trainer), _sampler_epoch_setter(trainer))  # fmt: skip
            self.restored = "epoch-end"
        else:
            self._remake_iterators(trainer)
            exact_state.seed_from_saved_rank(state, trainer.global_rank)
            self.restored = "derived"
        log.info("lightning_preempt: exact resume (%s) at epoch %d, batch %d of the epoch", self.restored,
                 trainer.current_epoch, state["batches_in_epoch"] if mid_epoch else 0)  # fmt: skip

    def on_train_epoch_start(self, trainer: pl.Trainer) -> None:
        """Note the RNG states each StatefulDataLoader's next iterator is made from.

        Lightning makes the epoch's iterators right after the ``on_train_epoch_start`` hooks
        (ours run after other callbacks', before the module's). A mid-epoch resume makes the
        iterator again from these states (see ``replays_sampler``). The first epoch of a
        process is noted by :meth:`on_train_start`, which makes that iterator again.
        """
        if not self.enabled:
            return
        if self._resharded:  # the resharded epoch is over: its samplers are back (set_epoch)
            self._resharded = False
            _compat.refresh_train_batches(trainer)
        if not self._loaders.is_current(_compat.train_loaders(trainer)):
            # New loaders (reload_dataloaders_every_n_epochs): wrap them before Lightning
            # makes this epoch's iterators; their samplers missed this epoch's set_epoch note.
            self._wrap(trainer)
            self._loaders.note_pre_iter(_compat.train_loaders(trainer), trainer.current_epoch)
            return
        self._loaders.note_epoch_start(_compat.train_loaders(trainer), trainer.current_epoch)

    def on_train_batch_end(self, trainer: pl.Trainer) -> None:
        """Fold the saved ``self.log`` aggregates in once the resumed run has logged them again."""
        if self._pending_results:
            merge_result_states(trainer, self._pending_results)

    # -- internals --
    def _wrap(self, trainer: pl.Trainer) -> None:
        self._loaders.wrap(_compat.train_loaders(trainer))
        fetcher = _compat.train_fetcher(trainer)
        if "stateful" in self._loaders.kinds and fetcher is not None and getattr(fetcher, "length", 0) is None:
            warnings.warn("lightning_preempt: the training data has no length, so Lightning fetches one batch ahead "
                          "and the saved StatefulDataLoader state is one batch past the last trained batch: a resume "
                          "skips it.\nHINT: give the dataset a __len__ (or resume from epoch ends).", stacklevel=2)  # fmt: skip

    def _remake_iterators(self, trainer: pl.Trainer, mid_epoch: bool = False) -> dict[int, int]:
        """:meth:`ResumableLoaders.remake_iterators` with Lightning's fetcher and sampler epoch."""
        return self._loaders.remake_iterators(_compat.train_loaders(trainer), trainer.current_epoch,
                                              _iterator_maker(trainer), _sampler_epoch_setter(trainer),
                                              mid_epoch=mid_epoch, replay_worker_draws=self.replay_worker_draws)  # fmt: skip

    def _drop_replayed(self, trainer: pl.Trainer, replay: dict[int, int]) -> None:
        """Take the replayed batches out of the remade iterators, past Lightning's counters."""
        if not any(replay.values()):
            return
        iterators = _compat.train_loader_iterators(trainer)
        if iterators is None:
            raise RuntimeError("lightning_preempt: cannot reach the training loader iterators to drop the replayed "
                               "batches\nHINT: set PreemptionCallback(...).exact.replay_worker_draws = False with this "
                               "Lightning version.")  # fmt: skip
        drop_replayed(iterators, replay)
