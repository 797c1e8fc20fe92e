"""Sample-exact resharding: an epoch begun at world size W goes on at world size M
(docs/elastic.md, "Data at a resize").

After k batches of b samples per rank a ``DistributedSampler`` world has consumed exactly the
first k·b·W positions of the epoch order, whatever W was: the resume drops those and splits
the rest among the M ranks now (:func:`share`; every index once, at most M-1 of padding).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from lightning_preempt.resume.samplers import (
    ResumableSampler,
    distributed_wrapped_sampler,
    set_iter_rng,
    snapshot_iter_rng,
)

ORDER_KEYS = ("n", "shuffle", "seed", "drop_last", "wrapped")
"""What defines an epoch's order besides its number; a resume with other values cannot reshard."""


def distributed_sampler(sampler: Any) -> DistributedSampler[Any] | None:
    """The ``DistributedSampler`` whose split resharding can redo (``None`` if ``sampler`` is
    none of: a plain ``DistributedSampler``, Lightning's ``DistributedSamplerWrapper``, either
    inside our ``ResumableSampler`` or :class:`ReshardedSampler`)."""
    if isinstance(sampler, ReshardedSampler):
        sampler = sampler.original
    if isinstance(sampler, ResumableSampler):
        sampler = sampler.inner
    if not isinstance(sampler, DistributedSampler):
        return None
    # (a subclass with its own order is not one)
    plain = type(sampler).__iter__ is DistributedSampler.__iter__
    return sampler if plain or distributed_wrapped_sampler(sampler) is not None else None


def order_record(
    sampler: DistributedSampler[Any], epoch: int, consumed: int, resharded: bool, drawn_from: dict[str, Any] | None
) -> dict[str, Any]:
    """What a checkpoint keeps of a loader's epoch order and of the world's position in it.

    ``drawn_from``: for a ``DistributedSamplerWrapper``, the RNG states (``snapshot_iter_rng``)
    the wrapped sampler's list of this epoch is drawn from; ``None`` for a plain sampler.
    """
    wrapped = distributed_wrapped_sampler(sampler) is not None
    return {
        "epoch": epoch, "n": len(sampler.dataset),  # type: ignore[arg-type]
        "shuffle": bool(sampler.shuffle), "seed": int(sampler.seed), "drop_last": bool(sampler.drop_last),
        "wrapped": wrapped, "num_replicas": int(sampler.num_replicas), "consumed": int(consumed),
        "resharded": resharded,  # this epoch was already split another way than the sampler's own
        "drawn_from": drawn_from if wrapped else None,
    }  # fmt: skip


def epoch_order(
    sampler: DistributedSampler[Any], epoch: int, pre_iter: dict[str, Any] | None, generators: list[torch.Generator]
) -> list[int]:
    """The whole epoch's order at world size 1 (no padding): what every split takes from.

    For a ``DistributedSamplerWrapper`` the wrapped sampler's list is drawn again from the
    states its epoch's iterator was made from (``pre_iter``: ``snapshot_iter_rng``), as
    ``samplers.rewound_sampler`` does at the same world size; the states of now are put back.
    """
    whole = copy.copy(sampler)
    whole.num_replicas, whole.rank, whole.drop_last = 1, 0, False
    whole.num_samples = whole.total_size = len(sampler.dataset)  # type: ignore[arg-type]
    whole.epoch = epoch
    positions = list(DistributedSampler.__iter__(whole))
    inner = distributed_wrapped_sampler(sampler)
    if inner is None:
        return positions
    now = snapshot_iter_rng(generators)
    if pre_iter is not None:
        set_iter_rng(generators, pre_iter)
    try:
        drawn = list(inner)
    finally:
        set_iter_rng(generators, now)
    return [drawn[p] for p in positions]


def share(order: list[int], consumed: int, num_replicas: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s part of what is left of ``order`` after ``consumed`` positions, split
    ``num_replicas`` ways as ``DistributedSampler`` splits (padding from the order's start)."""
    rest = order[min(consumed, len(order)) :]
    if drop_last:
        rest = rest[: len(rest) - len(rest) % num_replicas]
    elif rest and len(rest) % num_replicas:
        pad = num_replicas - len(rest) % num_replicas
        rest = rest + (order * math.ceil(pad / len(order)))[:pad]
    return rest[rank::num_replicas]


@dataclasses.dataclass(eq=False, repr=False)
class ReshardedSampler(Sampler[int]):
    """One rank's share of the rest of epoch ``epoch`` (see the module docstring).

    Installed as ``batch_sampler.sampler`` in place of ``original``; the first
    ``set_epoch`` to another epoch puts ``original`` back (and is forwarded to it, as every
    ``set_epoch`` is). ``lead`` is the samples this rank trained of the epoch before;
    ``drawn_from`` the states the order was drawn from (saved again with the next record).
    """

    original: Any
    batch_sampler: Any
    indices: list[int]
    _: dataclasses.KW_ONLY
    epoch: int
    lead: int
    consumed: int  # by the whole world, when this share began...
    batches: int  # ... at this batch of the epoch (every rank's count)
    num_replicas: int
    drawn_from: dict[str, Any] | None = None

    def __len__(self) -> int:
        return self.lead + len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the original sampler; a new epoch puts it back."""
        set_epoch = getattr(self.original, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if epoch != self.epoch and self.batch_sampler.sampler is self:
            self.batch_sampler.sampler = self.original

    def consumed_at(self, batches: int, batch_size: int) -> int:
        """What the world has consumed of the epoch once every rank trained ``batches``."""
        return self.consumed + (batches - self.batches) * batch_size * self.num_replicas
