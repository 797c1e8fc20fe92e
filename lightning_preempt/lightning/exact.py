"""Exact resume: the per-rank state Lightning does not put in its checkpoints.

Lightning restores weights, optimizers (AMP scaler included, via the precision plugin),
LR schedulers and loop counters. It does *not* save:

* RNG states (Python ``random``, NumPy, torch CPU and CUDA) and the states of the
  loaders' own ``torch.Generator`` objects: dropout, augmentations and the shuffling of
  later epochs differ from the uninterrupted run.
* the position in the epoch of a plain ``DataLoader``: a mid-epoch resume restarts the
  epoch's data from its first batch while the batch counter goes on. (Lightning saves a
  torchdata ``StatefulDataLoader``'s position; we restore its generators after it, and its
  ``DistributedSampler`` epoch: docs/exact-resume.md.)
* the state of ``torchmetrics`` metrics (their states are not ``persistent``) and the
  running ``on_epoch`` aggregates of ``self.log``.

:class:`ExactResume` captures those at save time (per rank: they go to each rank's
skeleton file, never to the DCP shards) and restores them at ``on_train_start``, the last
hook before the first batch of a resumed run is fetched. For a plain ``DataLoader`` whose
sampler is a ``SequentialSampler``, ``RandomSampler`` or ``DistributedSampler`` it swaps
in a :class:`ResumableSampler` that yields exactly what the original would (same
permutation, same draws from the global RNG) and can skip the batches already trained.

Restore points (why ``on_train_start``): on a mid-epoch restart Lightning calls neither
``on_train_epoch_start`` nor ``iter(dataloader)`` again, and nothing between
``on_train_start`` and the first fetch draws random numbers. When the checkpoint ended
an epoch, Lightning starts the next epoch without creating a new iterator; the
uninterrupted run did create one (it draws from the global torch RNG: a worker base
seed, and torchdata's samplers their epoch seed), so we create it again after restoring.

The RNG states each epoch's iterators are made from are noted when the epoch starts
(``ResumableSampler.set_epoch``, :meth:`ExactResume.on_train_epoch_start`) and saved: a
mid-epoch resume makes the iterators again from them (:func:`rewound_sampler` for a
``StatefulDataLoader`` whose sampler torchdata must iterate again to resume).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, cast

import lightning.pytorch as pl
import torch

from lightning_preempt.lightning import _compat
from lightning_preempt.resume.metrics import _clone, load_metric_states, metric_states
from lightning_preempt.resume.rng import (
    capture_rng,
    derive_seed,
    restore_rng,
    seed_all,
    set_generator_states,
    snapshot_iter_rng,
)
from lightning_preempt.resume.samplers import (
    ResumableSampler,
    _describe,
    _has_set_epoch,
    _replays_sampler,
    _workers,
    loader_generators,
    rewound_sampler,
    wrap_loader,
)

log = logging.getLogger(__name__)

STATE_KEY = "lightning_preempt"
"""Top-level checkpoint key of the exact-resume state (stays in the per-rank skeleton)."""

FORMAT_VERSION = 1


def result_states(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    """Running ``on_epoch`` aggregates of tensors logged with ``self.log`` during training."""
    results = _compat.training_results(trainer)
    out: dict[str, dict[str, Any]] = {}
    if results is None:
        return out
    for key, rm in results.items():
        if getattr(rm, "is_tensor", False) and rm.meta.on_epoch and not rm.has_reset:
            entry = {"value": _clone(rm.value)}
            if hasattr(rm, "cumulated_batch_size"):
                entry["cumulated_batch_size"] = _clone(rm.cumulated_batch_size)
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
            rm.cumulated_batch_size = rm.cumulated_batch_size + saved["cumulated_batch_size"].to(
                rm.cumulated_batch_size.device
            )


def _batches_done(trainer: pl.Trainer) -> int:
    """Batches of the current epoch trained so far (Lightning's counter; types say less)."""
    return int(cast(Any, trainer.fit_loop.epoch_loop.batch_progress.current).processed)


# ---- the orchestration used by PreemptionCallback ----------------------------------------
class ExactResume:
    """Captures and restores what an exact resume needs; driven by :class:`PreemptionCallback`.

    Set :attr:`enabled` to ``False`` to turn it off (the samplers are then left alone and
    nothing extra is saved).

    Worker processes draw their own random numbers (augmentations in ``__getitem__``) from
    a seed made when the epoch's iterator is made, and each draw moves them on. A mid-epoch
    resume gives the workers the same seed, but they have not drawn for the batches already
    trained. With :attr:`replay_worker_draws` the workers load those batches again (and we
    drop them), so their draws match an uninterrupted run bit for bit; it costs reading that
    part of the epoch again. Off by default: a warning says when it would matter.
    """

    def __init__(self, enabled: bool = True, replay_worker_draws: bool = False) -> None:
        self.enabled = enabled
        self.replay_worker_draws = replay_worker_draws
        self._loaded: dict[str, Any] | None = None
        self._samplers: list[tuple[str, ResumableSampler | None]] = []
        # Per loader (same order): for "stateful" loaders, (epoch, snapshot_iter_rng) taken
        # just before the epoch's iterator was made; a ResumableSampler keeps its own.
        self._stateful_pre_iter: list[tuple[int, dict[str, Any]] | None] = []
        self._wrapped: list[Any] = []  # the loaders _wrap saw (a reload makes new ones)
        self._warned_stale = False
        self._pending_results: dict[str, dict[str, Any]] = {}
        self._warned = False
        self.restored: str | None = None  # "mid-epoch", "epoch-end", "derived" (for tests and logs)

    # -- saving --
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
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
        loaders = []
        epoch = trainer.current_epoch
        if not self._current(trainer) and not self._warned_stale:
            self._warned_stale = True
            log.warning(
                "lightning_preempt: the training loaders were replaced without on_train_epoch_start being called; "
                "a mid-epoch resume from this checkpoint keeps the position but not the data order"
            )
        for i, (dl, (kind, sampler)) in enumerate(zip(self._train_loaders(trainer), self._samplers, strict=True)):
            pre_iter = sampler.pre_iter if sampler is not None else self._stateful_pre_iter[i]
            loaders.append(
                {
                    "kind": kind,
                    "epoch_state": sampler.epoch_state if sampler is not None else None,
                    "generators": [g.get_state() for g in loader_generators(dl)],
                    "pre_iter": pre_iter[1] if pre_iter is not None and pre_iter[0] == epoch else None,
                }
            )
        return {
            "version": FORMAT_VERSION,
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "batches_in_epoch": batches,
            "rng": capture_rng(),
            "loaders": loaders,
            "metrics": metric_states(pl_module),
            "results": result_states(trainer),
        }

    # -- loading --
    def load(self, state: dict[str, Any] | None) -> None:
        """Keep the saved state until :meth:`on_train_start` applies it."""
        if not self.enabled:
            return
        if state is not None and state.get("version") != FORMAT_VERSION:
            log.warning(
                "lightning_preempt: exact-resume state version %r is not %d; ignoring it (the resume is not exact)",
                state.get("version"),
                FORMAT_VERSION,
            )
            state = None
        self._loaded = state

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wrap the training samplers, then restore the saved state (last, just before data is fetched)."""
        if not self.enabled:
            return
        state, self._loaded = self._loaded, None
        num_batches = trainer.num_training_batches
        # Lightning goes on inside the saved epoch unless the save ended it (then it starts the next).
        mid_epoch = (
            state is not None
            and state.get("epoch") == trainer.current_epoch
            and 0 < state["batches_in_epoch"] < num_batches
        )
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
            self._restart_worker_iterators(trainer)
            return
        rank, world = trainer.global_rank, trainer.world_size
        if state.get("world_size") != world:
            log.warning(
                "lightning_preempt: the checkpoint was written by %d ranks, this run has %d: the data order and the "
                "random streams cannot match an uninterrupted run exactly",
                state.get("world_size"),
                world,
            )
        self._restore_data(state, mid_epoch)
        if mid_epoch:
            missing = load_metric_states(pl_module, state.get("metrics", {}))
            if missing:
                log.warning("lightning_preempt: saved metric states not found in the model: %s", missing)
            self._pending_results = dict(state.get("results", {}))
        if own and mid_epoch:
            # Remake the iterators from the RNG states this epoch's iterators were made from
            # (the workers get the same base seed), let the workers replay what they loaded
            # (replay_worker_draws), then restore the states of the moment of the save.
            self._set_pre_iter_rng(trainer, state)
            replay = self._restart_worker_iterators(trainer, mid_epoch=True)
            self._drop_replayed(trainer, replay)
            restore_rng(state["rng"])
            self._restore_generators(trainer, state)
            self.restored = "mid-epoch"
        elif own:
            # The save ended an epoch: the uninterrupted run made the next epoch's iterators
            # (reloading the loaders first, if due) after this point, from these states.
            restore_rng(state["rng"])
            if reload_after_restore:
                _compat.reload_train_data(trainer)
                self._wrap(trainer)  # new loaders: their generators are as train_dataloader() made them
            else:
                self._restore_generators(trainer, state)
            self._restart_iterators(trainer)
            self.restored = "epoch-end"
        else:
            self._restart_worker_iterators(trainer)
            seed = derive_seed(state["rng"], rank)
            seed_all(seed)
            self.restored = "derived"
            log.warning(
                "lightning_preempt: rank %d has no saved RNG state (the checkpoint had %s ranks); seeding it with %d, "
                "derived from rank %s's state",
                rank,
                state.get("world_size"),
                seed,
                state.get("rank"),
            )
        log.info(
            "lightning_preempt: exact resume (%s) at epoch %d, batch %d of the epoch",
            self.restored,
            trainer.current_epoch,
            state["batches_in_epoch"] if mid_epoch else 0,
        )

    def on_train_epoch_start(self, trainer: pl.Trainer) -> None:
        """Note the RNG states each StatefulDataLoader's next iterator is made from.

        Lightning makes the epoch's iterators right after the ``on_train_epoch_start`` hooks
        (ours run after other callbacks', before the module's). A mid-epoch resume makes the
        iterator again from these states (see :func:`_replays_sampler`). The first epoch of a
        process is noted by :meth:`on_train_start`, which makes that iterator again.
        """
        if not self.enabled:
            return
        if not self._current(trainer):
            # New loaders (reload_dataloaders_every_n_epochs): wrap them before Lightning
            # makes this epoch's iterators; their samplers missed this epoch's set_epoch note.
            self._wrap(trainer)
            self._note_pre_iter(trainer)
            return
        epoch = trainer.current_epoch
        for i, (dl, (kind, _)) in enumerate(zip(self._train_loaders(trainer), self._samplers, strict=True)):
            noted = self._stateful_pre_iter[i]
            if kind == "stateful" and (noted is None or noted[0] != epoch):
                self._stateful_pre_iter[i] = (epoch, snapshot_iter_rng(loader_generators(dl)))

    def on_train_batch_end(self, trainer: pl.Trainer) -> None:
        """Fold the saved ``self.log`` aggregates in once the resumed run has logged them again."""
        if self._pending_results:
            merge_result_states(trainer, self._pending_results)

    # -- internals --
    def _train_loaders(self, trainer: pl.Trainer) -> list[Any]:
        return _compat.train_loaders(trainer)

    def _current(self, trainer: pl.Trainer) -> bool:
        """The loaders that train are those :meth:`_wrap` saw (a reload makes new ones)."""
        loaders = self._train_loaders(trainer)
        return len(loaders) == len(self._wrapped) and all(a is b for a, b in zip(loaders, self._wrapped, strict=True))

    def _wrap(self, trainer: pl.Trainer) -> None:
        loaders = self._train_loaders(trainer)
        self._samplers = [wrap_loader(dl) for dl in loaders]
        self._stateful_pre_iter = [None] * len(loaders)
        self._wrapped = list(loaders)
        bad = [_describe(dl) for dl, (kind, _) in zip(loaders, self._samplers, strict=True) if kind == "unsupported"]
        if bad and not self._warned:
            self._warned = True
            warnings.warn(
                f"lightning_preempt: cannot resume the position of the training data {', '.join(bad)} "
                "mid-epoch: after a preemption the epoch restarts from its first batch while the step counter "
                "goes on.\nHINT: use torchdata.stateful_dataloader.StatefulDataLoader (a drop-in DataLoader "
                "that Lightning checkpoints), or a plain DataLoader with a Sequential/Random/DistributedSampler "
                "and the default batch sampler.",
                stacklevel=2,
            )
        self._check_prefetch(trainer)

    def _restart_worker_iterators(self, trainer: pl.Trainer, mid_epoch: bool = False) -> dict[int, int]:
        """Remake the iterators where needed; returns {loader index: batches to drop} (replay).

        Needed for worker loaders we wrapped (their workers asked the original sampler for
        indices as soon as Lightning made them); mid-epoch, for a StatefulDataLoader whose
        sampler takes ``set_epoch`` (torchdata made the resumed epoch's indices before
        Lightning set the epoch: we set it and hand the loader its own position again); and
        for a StatefulDataLoader that replays its sampler (:func:`_replays_sampler`): in a
        fresh process its first iterator is made again here, after the states it is made
        from are noted, so that a mid-epoch resume can make it from the same states.
        """
        loaders = self._train_loaders(trainer)
        pairs = list(zip(loaders, self._samplers, strict=True))
        wrapped_workers = [i for i, (dl, (kind, _)) in enumerate(pairs) if kind == "sampler" and _workers(dl)]
        epoch_samplers = [i for i, (dl, (kind, _)) in enumerate(pairs) if kind == "stateful" and _has_set_epoch(dl)]
        replaying = [i for i, (dl, (kind, _)) in enumerate(pairs) if kind == "stateful" and _replays_sampler(dl)]
        if mid_epoch:
            for dl, (kind, _) in pairs:
                if _workers(dl) and (kind == "stateful" or (kind == "sampler" and not self.replay_worker_draws)):
                    self._warn_worker_draws(dl)
        fetcher = _compat.train_fetcher(trainer)
        if fetcher is None or not (wrapped_workers or replaying or (mid_epoch and epoch_samplers)):
            return {}
        self._note_pre_iter(trainer)
        replay: dict[int, int] = {}
        for i, (dl, (kind, sampler)) in enumerate(pairs):
            if kind == "stateful":
                # iter(fetcher) remakes every loader's iterator: a StatefulDataLoader would lose
                # the position Lightning just loaded into it, so hand that position back first.
                _compat.set_sampler_epoch(dl, cast(Any, trainer.fit_loop.epoch_progress.current).processed)
                dl.load_state_dict(dl.state_dict())
            if mid_epoch and _workers(dl) and kind == "sampler" and sampler is not None and self.replay_worker_draws:
                replay[i] = sampler.replay()
        with contextlib.ExitStack() as stack:
            for i in replaying:  # dl.load_state_dict above: torchdata iterates the sampler again
                noted = self._stateful_pre_iter[i]
                if noted is not None:
                    stack.enter_context(rewound_sampler(loaders[i], noted[1]))
            iter(fetcher)
        return replay

    def _note_pre_iter(self, trainer: pl.Trainer) -> None:
        """Note, for every loader, the states the iterators about to be made are made from."""
        epoch = trainer.current_epoch
        for i, (dl, (kind, sampler)) in enumerate(zip(self._train_loaders(trainer), self._samplers, strict=True)):
            if sampler is not None:  # (see ResumableSampler.set_epoch)
                sampler.pre_iter = (epoch, snapshot_iter_rng(sampler.generators))
            elif kind == "stateful":
                self._stateful_pre_iter[i] = (epoch, snapshot_iter_rng(loader_generators(dl)))

    def _drop_replayed(self, trainer: pl.Trainer, replay: dict[int, int]) -> None:
        """Take the replayed batches out of the remade iterators, past Lightning's counters."""
        if not any(replay.values()):
            return
        iterators = _compat.train_loader_iterators(trainer)
        if iterators is None:
            raise RuntimeError(
                "lightning_preempt: cannot reach the training loader iterators to drop the replayed batches\n"
                "HINT: set PreemptionCallback(...).exact.replay_worker_draws = False with this Lightning version."
            )
        for i, n in replay.items():
            for _ in range(n):
                next(iterators[i])

    def _warn_worker_draws(self, loader: Any) -> None:
        warnings.warn(
            f"lightning_preempt: resuming mid-epoch with worker processes ({_describe(loader)}): random draws made "
            "inside the workers (augmentations in __getitem__) start again from the epoch's worker seed, so for "
            "the rest of this epoch they differ from an uninterrupted run (the next epochs match again).\n"
            "HINT: if the workers draw random numbers, set PreemptionCallback(...).exact.replay_worker_draws = True "
            "(plain DataLoader: the workers load this epoch's trained batches again), or draw them from a "
            "generator seeded with the sample index (and the epoch).",
            stacklevel=2,
        )

    def _set_pre_iter_rng(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        saved = state.get("loaders", [])
        if len(saved) != len(self._samplers):
            return
        for dl, entry in zip(self._train_loaders(trainer), saved, strict=True):
            pre_iter = entry.get("pre_iter")
            if pre_iter is not None:
                torch.set_rng_state(pre_iter["torch"])  # the same for every loader (one moment)
                set_generator_states(loader_generators(dl), pre_iter["generators"])

    def _restore_generators(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        saved = state.get("loaders", [])
        if len(saved) != len(self._samplers):
            return  # _restore_data warned
        for dl, entry in zip(self._train_loaders(trainer), saved, strict=True):
            if "generators" in entry and not set_generator_states(loader_generators(dl), entry["generators"]):
                log.warning(
                    "lightning_preempt: the training loader %s has %d torch generators, the checkpoint %d: "
                    "not restoring them (the data order of the next epochs will differ)",
                    _describe(dl),
                    len(loader_generators(dl)),
                    len(entry["generators"]),
                )

    def _check_prefetch(self, trainer: pl.Trainer) -> None:
        fetcher = _compat.train_fetcher(trainer)
        stateful = any(kind == "stateful" for kind, _ in self._samplers)
        if stateful and fetcher is not None and getattr(fetcher, "length", 0) is None:
            warnings.warn(
                "lightning_preempt: the training data has no length, so Lightning fetches one batch ahead and the "
                "saved StatefulDataLoader state is one batch past the last trained batch: a resume skips it.\n"
                "HINT: give the dataset a __len__ (or resume from epoch ends).",
                stacklevel=2,
            )

    def _restore_data(self, state: dict[str, Any], mid_epoch: bool) -> None:
        saved = state.get("loaders", [])
        if len(saved) != len(self._samplers):
            if mid_epoch:
                log.warning(
                    "lightning_preempt: %d training loaders now, %d when saved: not resuming their positions",
                    len(self._samplers),
                    len(saved),
                )
            return
        if not mid_epoch:
            return
        for (kind, sampler), entry in zip(self._samplers, saved, strict=True):
            if kind == "sampler" and sampler is not None:
                epoch_state = entry.get("epoch_state") if entry.get("kind") == "sampler" else None
                sampler.resume_at(epoch_state, state["batches_in_epoch"] * sampler.batch_size)
            elif kind == "unsupported":
                log.warning(
                    "lightning_preempt: resuming mid-epoch (batch %d) with a data loader whose position is not "
                    "saved: this epoch's data starts again from its first batch",
                    state["batches_in_epoch"],
                )

    def _restart_iterators(self, trainer: pl.Trainer) -> None:
        # The save ended an epoch. The uninterrupted run creates the next epoch's iterators
        # after this point (drawing a worker base seed, and for torchdata's samplers the
        # epoch's seed); the resumed run created them before the restore. Create them again
        # now, after the sampler epoch is set the way Lightning is about to set it.
        epoch = cast(Any, trainer.fit_loop.epoch_progress.current).processed
        for dl in self._train_loaders(trainer):
            _compat.set_sampler_epoch(dl, epoch)
        fetcher = _compat.train_fetcher(trainer)
        if fetcher is not None:
            self._note_pre_iter(trainer)
            iter(fetcher)

