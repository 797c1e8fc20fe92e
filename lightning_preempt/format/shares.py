"""DDP: which rank stages and writes which replicated tensor (its share of the save)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

# DDP: DCP de-duplicates replicated tensors only after every rank staged all of them (N
# times the host memory). So each plain tensor gets one owner rank before staging; DTensors
# are always kept. Only when all ranks hold the same keys, shapes and dtypes
# (:func:`replica_fingerprint`), else a rank could own a tensor it lacks.


def _is_plain(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor)


def replica_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of every plain tensor's key, shape and dtype: equal on all ranks exactly
    when :func:`replica_owners` gives every rank the same assignment."""
    import hashlib

    h = hashlib.sha1()
    for key in sorted(k for k, t in tensors.items() if _is_plain(t)):
        t = tensors[key]
        h.update(f"{key}\0{tuple(t.shape)}\0{t.dtype}\n".encode())
    return h.hexdigest()


def replica_owners(tensors: dict[str, torch.Tensor], world_size: int) -> dict[str, int]:
    """The rank that stages and writes each plain tensor: largest first to the rank with
    the fewest bytes so far (lowest rank on a tie; keys break size ties), so every rank
    computes the same map and the largest rank's share stays close to 1/N."""
    plain = [(t.numel() * t.element_size(), key) for key, t in tensors.items() if _is_plain(t)]
    plain.sort(key=lambda sk: (-sk[0], sk[1]))
    loads = [0] * world_size
    owners: dict[str, int] = {}
    for size, key in plain:
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[key] = rank
        loads[rank] += size
    return owners


def own_share(tensors: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The tensors ``rank`` stages and writes: the plain ones it owns, and every DTensor."""
    if world_size <= 1:
        return tensors
    owners = replica_owners(tensors, world_size)
    return {k: t for k, t in tensors.items() if owners.get(k, rank) == rank}


class ShareMemo:
    """:func:`replica_fingerprint` and :func:`own_share`'s choice, kept while keys, types,
    shapes and dtypes stay (~15 ms to recompute, ~1 ms to check)."""

    def __init__(self) -> None:
        self._signature: tuple[list[Any], ...] | None = None
        self._fingerprint = ""
        self._mine: dict[tuple[int, int], list[str]] = {}

    def share(
        self, tensors: dict[str, torch.Tensor], rank: int, gather: Callable[[str], list[str]]
    ) -> dict[str, torch.Tensor] | None:
        """:func:`own_share` of ``tensors`` for ``rank``, after ``gather`` (every rank's
        fingerprint, this one's given) found every rank holding the same tensors; ``None``
        when they do not."""
        values = list(tensors.values())
        signature = (list(tensors), list(map(type, values)), list(map(_SHAPE, values)), list(map(_DTYPE, values)))
        if signature != self._signature:
            self._signature, self._mine = signature, {}
            self._fingerprint = replica_fingerprint(tensors)
        fingerprints = gather(self._fingerprint)
        if len(set(fingerprints)) != 1:
            return None
        world_size = len(fingerprints)
        if world_size <= 1:
            return tensors
        keys = self._mine.get((rank, world_size))
        if keys is None:
            keys = self._mine[(rank, world_size)] = list(own_share(tensors, rank, world_size))
        return {key: tensors[key] for key in keys}


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
