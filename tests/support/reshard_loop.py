"""A hand-written training loop over the neutral exact-resume pieces, for the resharding tests.

:func:`stretch` trains one rank from a saved state (or afresh) for a number of batches of one
epoch, as a front-end of a hand-written loop drives ``resume.loaders.ResumableLoaders``: wrap,
set the sampler epoch, note the epoch start, reshard what was split another way, make the
iterator, train, capture. It returns the sample indices trained and the state to save.
Used in one process (the ranks one after the other) and in real gloo ranks (``ranks.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_preempt.resume.loaders import ResumableLoaders

KINDS = ("dataloader", "stateful", "stateful-wrapper")
PLAIN_KINDS = KINDS[:2]  # without Lightning's wrapper: no Lightning import (seconds) in a fresh rank


def make_loader(kind: str, n: int, batch_size: int, world: int, rank: int, *, drop_last: bool = False) -> Any:
    """``kind``: a DataLoader or StatefulDataLoader over a DistributedSampler (as Lightning
    injects it), or a StatefulDataLoader over Lightning's DistributedSamplerWrapper around
    torchdata's RandomSampler (what Lightning makes of ``StatefulDataLoader(shuffle=True)``)."""
    data = TensorDataset(torch.arange(n))
    if kind == "stateful-wrapper":
        from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler

        inner = RandomSampler(data, generator=torch.Generator().manual_seed(5))
        sampler: Any = DistributedSamplerWrapper(inner, num_replicas=world, rank=rank, seed=3, drop_last=drop_last)
        return StatefulDataLoader(data, sampler=sampler, batch_size=batch_size)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3, drop_last=drop_last)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, sampler=sampler, batch_size=batch_size)
    return DataLoader(data, sampler=sampler, batch_size=batch_size)


def stretch(
    kind: str, n: int, batch_size: int, world: int, rank: int, saved: dict[str, Any] | None, epoch: int, stop: int | None,
    *, drop_last: bool = False,
) -> tuple[list[int], dict[str, Any]]:  # fmt: skip
    """Train ``stop`` batches (``None``: to the epoch's end) of ``epoch`` on ``rank`` of ``world``,
    resuming from ``saved`` (a state this function returned, any world's). Returns the
    indices trained and the state after them."""
    loader = make_loader(kind, n, batch_size, world, rank, drop_last=drop_last)
    loaders = ResumableLoaders()
    loaders.wrap([loader])
    for s in {loader.sampler, loader.batch_sampler.sampler}:
        s.set_epoch(epoch)
    done = 0
    resuming = saved is not None and saved["epoch"] == epoch
    if resuming:
        # As Lightning: the loop made an iterator before the restore (a wrapper drew its list,
        # moving its generator on), and notes no epoch start for an epoch it goes on with.
        iter(loader)
    else:
        loaders.note_epoch_start([loader], epoch)
    if resuming:
        assert saved is not None
        done = saved["batches"]
        resharded = loaders.reshard([loader], saved["loaders"], epoch, done)
        assert resharded == {0}, "a change of world size reshards every distributed loader"
        loaders.restore_positions(saved["loaders"], True, done, resharded)
        loaders.remake_resharded([loader], resharded, None)
    trained: list[int] = []
    for (batch,) in loader:
        trained += batch.tolist()
        done += 1
        if stop is not None and len(trained) >= stop * batch_size:
            break
    return trained, {"epoch": epoch, "batches": done, "loaders": loaders.capture([loader], epoch, done)}


def rank_worker(rank: int, world: int, status: str, phase: int, plan: str) -> None:
    """One rank of one phase of the gloo test: every kind, resumed from this rank's state of
    the previous phase (rank 0's where this rank did not exist), trained as ``plan`` says."""
    import torch.distributed as dist

    steps = json.loads(plan)
    out: dict[str, Any] = {}
    for kind in PLAIN_KINDS:
        saved = None
        if phase > 0:
            prev = os.path.join(status, f"{phase - 1}-{kind}-rank{{}}.pt")
            path = prev.format(rank) if os.path.exists(prev.format(rank)) else prev.format(0)
            saved = torch.load(path, weights_only=False)
        epoch, stop = steps[phase]
        trained, state = stretch(kind, 48, 4, dist.get_world_size(), dist.get_rank(), saved, epoch, stop)
        if stop is None:  # then the next epoch in full: its samplers are the plain ones again
            more, state = stretch(kind, 48, 4, world, rank, None, epoch + 1, None)
            out[f"{kind}-next"] = more
        torch.save(state, os.path.join(status, f"{phase}-{kind}-rank{rank}.pt"))
        out[kind] = trained
    with open(os.path.join(status, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
