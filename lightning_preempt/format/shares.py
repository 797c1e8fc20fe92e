"""DDP: which rank stages and writes which replicated tensor (its share of the save)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_preempt.format.structure import Structure

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


def balance(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """The rank of each key: largest first to the rank with the fewest bytes so far (lowest
    rank on a tie; keys break size ties), so every rank computes the same map and the largest
    rank's share stays close to 1/N."""
    loads = [0] * world_size
    owners: dict[str, int] = {}
    for key, size in sorted(sizes.items(), key=lambda ks: (-ks[1], ks[0])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[key] = rank
        loads[rank] += size
    return owners


def replica_owners(tensors: dict[str, torch.Tensor], world_size: int) -> dict[str, int]:
    """The rank that stages and writes each plain tensor (:func:`balance` of their bytes)."""
    return balance({key: t.numel() * t.element_size() for key, t in tensors.items() if _is_plain(t)}, world_size)


def own_share(tensors: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The tensors ``rank`` stages and writes: the plain ones it owns, and every DTensor."""
    if world_size <= 1:
        return tensors
    owners = replica_owners(tensors, world_size)
    return {k: t for k, t in tensors.items() if owners.get(k, rank) == rank}


class ShareMemo:
    """:func:`replica_fingerprint` and :func:`own_share`'s choice, kept for one structure key
    (format/structure.py; ~15 ms to recompute)."""

    def __init__(self) -> None:
        self._key: Structure | None = None
        self._fingerprint = ""
        self._mine: dict[tuple[int, int], list[str]] = {}
        #: the last save's ranks held different tensors: every rank stages all until they agree
        self.differ = False

    def share(
        self, tensors: dict[str, torch.Tensor], rank: int, world_size: int, key: Structure
    ) -> tuple[str, dict[str, torch.Tensor]]:
        """(:func:`replica_fingerprint`, :func:`own_share`) of ``tensors`` (of structure ``key``)
        for ``rank``; all of them while :attr:`differ`. The share holds only where every rank's
        fingerprint is this one: the caller gathers them for :meth:`agreed`."""
        if key is not self._key:
            self._key, self._mine, self._fingerprint = key, {}, replica_fingerprint(tensors)
        if world_size <= 1 or self.differ:
            return self._fingerprint, tensors
        mine = self._mine.get((rank, world_size))
        if mine is None:
            mine = self._mine[(rank, world_size)] = list(own_share(tensors, rank, world_size))
        return self._fingerprint, {k: tensors[k] for k in mine}

    def agreed(self, fingerprints: list[bytes]) -> bool:
        """Whether every rank's fingerprint is the same; a tensor only some ranks hold would be
        lost if its owner lacked it, so otherwise every rank stages all (from the start of the
        saves after, while they keep differing)."""
        self.differ = len(set(fingerprints)) != 1
        return not self.differ
