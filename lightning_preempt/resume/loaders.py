"""Per-loader bookkeeping of exact resume, for any loop that iterates a list of training loaders:
which loaders are wrapped (a :class:`ResumableSampler`), which save their own position
(``"stateful"``: a torchdata ``StatefulDataLoader``) and which cannot resume. It never
touches a training loop: a front-end passes the loaders, the epoch and small callables
(docs/design.md, "Exact resume: the loaders' call order")."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning_preempt.resume.exact_state import restore_rng, seed_from_saved_rank
from lightning_preempt.resume.reshard import (
    ORDER_KEYS,
    ReshardedSampler,
    distributed_sampler,
    epoch_order,
    order_record,
    share,
)
from lightning_preempt.resume.samplers import (
    ResumableSampler,
    describe_loader,
    has_set_epoch,
    has_workers,
    loader_generators,
    replays_sampler,
    rewound_sampler,
    set_generator_states,
    set_iter_rng,
    snapshot_iter_rng,
    wrap_loader,
)

log = logging.getLogger(__name__)

SetSamplerEpoch = Callable[[Any], None]
"""Sets a loader's sampler epoch the way the loop is about to (Lightning: ``_set_sampler_epoch``)."""


class ResumableLoaders:
    """Which training loaders are wrapped, stateful or unsupported, and what their resume needs.

    Args:
        replay_setting: how the user turns on replaying worker draws, named in the warning
            given when a mid-epoch resume with worker processes cannot replay them.
    """

    def __init__(self, replay_setting: str = "replay_worker_draws") -> None:
        self.replay_setting = replay_setting
        self._samplers: list[tuple[str, ResumableSampler | None]] = []
        # Per loader (same order): for "stateful" loaders, (epoch, snapshot_iter_rng) taken
        # just before the epoch's iterator was made; a ResumableSampler keeps its own.
        self._stateful_pre_iter: list[tuple[int, dict[str, Any]] | None] = []
        self._wrapped: list[Any] = []  # the loaders wrap() saw (a reload makes new ones)
        self._warned = False  # the unsupported-loader warning is given once per process

    @property
    def kinds(self) -> list[str]:
        """Per wrapped loader: ``"sampler"``, ``"stateful"`` or ``"unsupported"`` (see :func:`wrap_loader`)."""
        return [kind for kind, _ in self._samplers]

    def wrap(self, loaders: Sequence[Any]) -> None:
        """Install a :class:`ResumableSampler` where safe; warn (once) about loaders that cannot resume."""
        self._samplers = [wrap_loader(dl) for dl in loaders]
        self._stateful_pre_iter = [None] * len(loaders)
        self._wrapped = list(loaders)
        bad = [describe_loader(dl) for dl, kind in zip(loaders, self.kinds, strict=True) if kind == "unsupported"]
        if bad and not self._warned:
            self._warned = True
            warnings.warn(f"lightning_preempt: cannot resume the position of the training data {', '.join(bad)} "
                          "mid-epoch: after a preemption the epoch restarts from its first batch while the step "
                          "counter goes on.\nHINT: use torchdata.stateful_dataloader.StatefulDataLoader (a drop-in "
                          "DataLoader that Lightning checkpoints), or a plain DataLoader with a Sequential/Random/"
                          "DistributedSampler and the default batch sampler.", stacklevel=2)  # fmt: skip

    def is_current(self, loaders: Sequence[Any]) -> bool:
        """``loaders`` are the very objects :meth:`wrap` saw (a reload makes new ones)."""
        return len(loaders) == len(self._wrapped) and all(a is b for a, b in zip(loaders, self._wrapped, strict=True))

    def note_epoch_start(self, loaders: Sequence[Any], epoch: int) -> None:
        """Note, for stateful loaders not yet noted this epoch, the states their iterator is made from."""
        for i, (dl, kind) in enumerate(zip(loaders, self.kinds, strict=True)):
            noted = self._stateful_pre_iter[i]
            if kind == "stateful" and (noted is None or noted[0] != epoch):
                self._stateful_pre_iter[i] = (epoch, snapshot_iter_rng(loader_generators(dl)))

    def note_pre_iter(self, loaders: Sequence[Any], epoch: int) -> None:
        """Note, for every loader, the states the iterators about to be made are made from."""
        for i, (dl, (kind, sampler)) in enumerate(zip(loaders, self._samplers, strict=True)):
            if sampler is not None:  # (see ResumableSampler.set_epoch)
                sampler.pre_iter = (epoch, snapshot_iter_rng(sampler.generators))
            elif kind == "stateful":
                self._stateful_pre_iter[i] = (epoch, snapshot_iter_rng(loader_generators(dl)))

    def capture(self, loaders: Sequence[Any], epoch: int, batches_in_epoch: int = 0) -> list[dict[str, Any]]:
        """One saved entry per loader: its kind, its epoch's order, its generators' states,
        the states its ``epoch`` iterator was made from (``None`` if not noted this epoch) and,
        for a distributed sampler, what defines the epoch's order and how much of it the
        whole world consumed in ``batches_in_epoch`` batches per rank (``reshard.order_record``)."""
        entries = []
        for i, (dl, (kind, sampler)) in enumerate(zip(loaders, self._samplers, strict=True)):
            pre_iter = sampler.pre_iter if sampler is not None else self._stateful_pre_iter[i]
            entries.append({
                "kind": kind, "epoch_state": sampler.epoch_state if sampler is not None else None,
                "generators": [g.get_state() for g in loader_generators(dl)],
                "pre_iter": pre_iter[1] if pre_iter is not None and pre_iter[0] == epoch else None,
                "order": _order(dl, epoch, batches_in_epoch, pre_iter[1] if pre_iter is not None else None),
            })  # fmt: skip
        return entries

    def reshard(self, loaders: Sequence[Any], saved: list[dict[str, Any]], epoch: int, batches_in_epoch: int) -> set[int]:
        """Mid-epoch: give every loader whose saved epoch was split among another number of
        ranks (or already resharded) this rank's share of the rest of that epoch; returns their
        indices. Loaders whose order is defined otherwise now are warned about and left."""
        if len(saved) != len(self._samplers):
            return set()
        done: set[int] = set()
        for i, (dl, entry) in enumerate(zip(loaders, saved, strict=True)):
            rec, batch_sampler = entry.get("order"), getattr(dl, "batch_sampler", None)
            if batch_sampler is None:
                continue
            current = getattr(batch_sampler, "sampler", None)
            sampler = distributed_sampler(current)
            if rec is None or sampler is None or rec["epoch"] != epoch or rec["consumed"] >= rec["n"]:
                continue  # (an epoch consumed in full: the next one starts, nothing to split)
            if rec["num_replicas"] == sampler.num_replicas and not rec["resharded"]:
                continue  # the epoch's own split: positions restore as saved (bit-identical)
            now = order_record(sampler, epoch, 0, False, None)
            if any(now[k] != rec[k] for k in ORDER_KEYS):
                log.warning(
                    "lightning_preempt: the training loader %s orders epoch %d otherwise than when saved (%s, then %s): "
                    "not resharding it, this epoch's samples are not each seen once",
                    describe_loader(dl), epoch, {k: now[k] for k in ORDER_KEYS}, {k: rec[k] for k in ORDER_KEYS},
                )  # fmt: skip
                continue
            drawn_from = rec.get("drawn_from")
            order = epoch_order(sampler, epoch, drawn_from, loader_generators(dl))
            size = int(batch_sampler.batch_size)
            indices = share(order, rec["consumed"], sampler.num_replicas, sampler.rank, sampler.drop_last)
            original = current.original if isinstance(current, ReshardedSampler) else current
            batch_sampler.sampler = ReshardedSampler(
                original, batch_sampler, indices, epoch=epoch, lead=batches_in_epoch * size,
                consumed=rec["consumed"], batches=batches_in_epoch, num_replicas=sampler.num_replicas,
                drawn_from=drawn_from,
            )  # fmt: skip
            done.add(i)
            log.info(
                "lightning_preempt: epoch %d was split %d ways, now %d: %d of its %d samples were trained, "
                "rank %d takes %d of the rest",
                epoch, rec["num_replicas"], sampler.num_replicas, min(rec["consumed"], len(order)), len(order),
                sampler.rank, len(indices),
            )  # fmt: skip
        return done

    def remake_resharded(self, loaders: Sequence[Any], resharded: set[int], make_iterators: Callable[[], object] | None) -> None:
        """Make the iterators again after :meth:`reshard`: a resharded StatefulDataLoader starts
        afresh from its share (the position it loaded counts in the old split); the other
        stateful loaders keep theirs."""
        for i, (dl, kind) in enumerate(zip(loaders, self.kinds, strict=True)):
            if kind == "stateful":
                dl.load_state_dict({} if i in resharded else dl.state_dict())
        if make_iterators is not None:
            make_iterators()

    def restore_positions(
        self, saved: list[dict[str, Any]], mid_epoch: bool, batches_in_epoch: int = 0, resharded: set[int] | None = None
    ) -> bool:
        """Mid-epoch: make each wrapped sampler's next epoch replay the saved order and skip
        ``batches_in_epoch`` batches (warned for loaders whose position is not saved). Returns
        whether every loader goes on at its saved position in its saved order."""
        if not mid_epoch:
            return False
        if len(saved) != len(self._samplers):
            log.warning("lightning_preempt: %d training loaders now, %d when saved: not resuming their positions",
                        len(self._samplers), len(saved))  # fmt: skip
            return False
        exact = True
        for i, ((kind, sampler), entry) in enumerate(zip(self._samplers, saved, strict=True)):
            exact = exact and kind in ("sampler", "stateful") and entry.get("kind") == kind
            if resharded and i in resharded:
                continue  # its ReshardedSampler holds the rest of the epoch
            if kind == "sampler" and sampler is not None:
                epoch_state = entry.get("epoch_state") if entry.get("kind") == "sampler" else None
                sampler.resume_at(epoch_state, batches_in_epoch * sampler.batch_size)
            elif kind == "unsupported":
                log.warning("lightning_preempt: resuming mid-epoch (batch %d) with a data loader whose position is "
                            "not saved: this epoch's data starts again from its first batch", batches_in_epoch)  # fmt: skip
        return exact

    def set_pre_iter_rng(self, loaders: Sequence[Any], saved: list[dict[str, Any]]) -> None:
        """Set the global torch RNG and the generators to the states the saved epoch's iterators were made from."""
        if len(saved) != len(self._samplers):
            return
        for dl, entry in zip(loaders, saved, strict=True):
            if entry.get("pre_iter") is not None:  # (the global state: the same for every loader, one moment)
                set_iter_rng(loader_generators(dl), entry["pre_iter"])

    def restore_generators(self, loaders: Sequence[Any], saved: list[dict[str, Any]]) -> None:
        """Set every loader's generators to their states at the save (warned when the counts differ)."""
        if len(saved) != len(self._samplers):
            return  # restore_positions warned
        for dl, entry in zip(loaders, saved, strict=True):
            if "generators" in entry and not set_generator_states(loader_generators(dl), entry["generators"]):
                log.warning("lightning_preempt: the training loader %s has %d torch generators, the checkpoint %d: not "
                            "restoring them (the data order of the next epochs will differ)", describe_loader(dl),
                            len(loader_generators(dl)), len(entry["generators"]))  # fmt: skip

    def restore_states(self, loaders: Sequence[Any], state: dict[str, Any], rank: int) -> bool:
        """The RNG states and the loaders' generators of the save, where ``rank`` saved ``state``
        (returns ``True``); another rank's state seeds this rank from it (deterministic, warned)."""
        if state.get("rank") != rank:
            seed_from_saved_rank(state, rank)
            return False
        restore_rng(state["rng"])
        self.restore_generators(loaders, state.get("loaders", []))
        return True

    def remake_iterators(self, loaders: Sequence[Any], epoch: int, make_iterators: Callable[[], object] | None,
                         set_sampler_epoch: SetSamplerEpoch, *, mid_epoch: bool = False,
                         replay_worker_draws: bool = False) -> dict[int, int]:  # fmt: skip
        """Make the loop's iterators again where needed; returns {loader index: batches to drop}.

        Needed for worker loaders (started before the front-end set them up, and fed by the
        original sampler), mid-epoch for a StatefulDataLoader whose sampler takes ``set_epoch``
        (torchdata made the epoch's indices before the epoch was set), and for one that
        replays its sampler (:func:`replays_sampler`: remade after its states are noted).
        ``make_iterators`` ``None``: the loop has none yet. With ``replay_worker_draws`` the
        workers load the trained batches again: the caller drops them (:func:`drop_replayed`).
        """
        pairs = list(zip(loaders, self._samplers, strict=True))
        kinds = self.kinds
        # Worker loaders of both kinds: their workers were started before the front-end could
        # set them up (preemption/signals.py), and a wrapped sampler's were fed by the original.
        wrapped_workers = [i for i, dl in enumerate(loaders) if kinds[i] in ("sampler", "stateful") and has_workers(dl)]
        epoch_samplers = [i for i, dl in enumerate(loaders) if kinds[i] == "stateful" and has_set_epoch(dl)]
        replaying = [i for i, dl in enumerate(loaders) if kinds[i] == "stateful" and replays_sampler(dl)]
        if mid_epoch:
            for dl, kind in zip(loaders, kinds, strict=True):
                if has_workers(dl) and (kind == "stateful" or (kind == "sampler" and not replay_worker_draws)):
                    self._warn_worker_draws(dl)
        if make_iterators is None or not (wrapped_workers or replaying or (mid_epoch and epoch_samplers)):
            return {}
        self.note_pre_iter(loaders, epoch)
        replay: dict[int, int] = {}
        for i, (dl, (kind, sampler)) in enumerate(pairs):
            if kind == "stateful":
                # Making the iterators again would lose the position the loop just loaded
                # into a StatefulDataLoader: hand that position back first.
                set_sampler_epoch(dl)
                dl.load_state_dict(dl.state_dict())
            if mid_epoch and has_workers(dl) and kind == "sampler" and sampler is not None and replay_worker_draws:
                replay[i] = sampler.replay()
        with contextlib.ExitStack() as stack:
            for i in replaying:  # dl.load_state_dict above: torchdata iterates the sampler again
                noted = self._stateful_pre_iter[i]
                if noted is not None:
                    stack.enter_context(rewound_sampler(loaders[i], noted[1]))
            make_iterators()
        return replay

    def make_next_epoch_iterators(self, loaders: Sequence[Any], epoch: int, make_iterators: Callable[[], object] | None,
                                  set_sampler_epoch: SetSamplerEpoch) -> None:  # fmt: skip
        """After restoring a save that ended an epoch: make the next epoch's iterators again,
        from the restored states, as the uninterrupted run made them after its save."""
        for dl in loaders:
            set_sampler_epoch(dl)
        if make_iterators is not None:
            self.note_pre_iter(loaders, epoch)
            make_iterators()

    def _warn_worker_draws(self, loader: Any) -> None:
        warnings.warn(  # stacklevel: the front-end's call of remake_iterators
            f"lightning_preempt: resuming mid-epoch with worker processes ({describe_loader(loader)}): random draws "
            "made inside the workers (augmentations in __getitem__) start again from the epoch's worker seed, so "
            "for the rest of this epoch they differ from an uninterrupted run (the next epochs match again).\n"
            f"HINT: if the workers draw random numbers, set {self.replay_setting} = True (plain DataLoader: the "
            "workers load this epoch's trained batches again), or draw them from a generator seeded with the "
            "sample index (and the epoch).", stacklevel=3)  # fmt: skip


def _order(loader: Any, epoch: int, batches: int, pre_iter: dict[str, Any] | None) -> dict[str, Any] | None:
    """``reshard.order_record`` of ``loader`` after ``batches`` per rank (``None``: no distributed
    sampler); ``pre_iter``: the states this epoch's iterator was made from, noted in this process."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    current = getattr(batch_sampler, "sampler", None)
    sampler = distributed_sampler(current)
    if sampler is None or getattr(batch_sampler, "batch_size", None) is None:
        return None
    size = int(batch_sampler.batch_size)  # type: ignore[union-attr]
    if isinstance(current, ReshardedSampler) and current.epoch == epoch:
        # The order was drawn in an earlier process: from the states that process saved.
        return order_record(sampler, epoch, current.consumed_at(batches, size), True, current.drawn_from)
    return order_record(sampler, epoch, batches * size * sampler.num_replicas, False, pre_iter)


def drop_replayed(iterators: Sequence[Iterator[Any]], replay: dict[int, int]) -> None:
    """Take the replayed batches (:meth:`ResumableLoaders.remake_iterators`) out of the live iterators."""
    for i, n in replay.items():
        for _ in range(n):
            next(iterators[i])
