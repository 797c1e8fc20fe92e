"""A ``DataLoader``'s position and order for exact resume: samplers that replay an epoch's
order and skip what was trained, and the generators (and RNG states) that decide it."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler


def snapshot_iter_rng(generators: list[torch.Generator]) -> dict[str, Any]:
    """The RNG states that ``iter(loader)`` draws from: the global torch RNG and ``generators``."""
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in generators]}


def set_iter_rng(generators: list[torch.Generator], snapshot: dict[str, Any]) -> None:
    """Put back the states :func:`snapshot_iter_rng` took (the global torch RNG and ``generators``)."""
    torch.set_rng_state(snapshot["torch"])
    set_generator_states(generators, snapshot["generators"])


def set_generator_states(generators: list[torch.Generator], states: list[Any]) -> bool:
    """Set each generator to its saved state; ``False`` (nothing set) when the counts differ."""
    if len(generators) != len(states):
        return False
    for g, state in zip(generators, states, strict=True):
        g.set_state(state)
    return True


def _is_plain(sampler: Any, cls: type) -> bool:
    """``sampler`` is ``cls`` or a subclass that does not change how it iterates."""
    return isinstance(sampler, cls) and getattr(type(sampler), "__iter__", None) is getattr(cls, "__iter__", None)


def distributed_wrapped_sampler(sampler: Any) -> Any | None:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` (``None`` if
    ``sampler`` is not one), recognised by its class name: this layer runs without Lightning
    (tests/unit/test_exact_compat.py checks the layout on every version CI runs)."""
    if type(sampler).__name__ != "DistributedSamplerWrapper" or not isinstance(sampler, DistributedSampler):
        return None
    return getattr(sampler.dataset, "_sampler", None)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects that decide ``loader``'s order and worker seeds, each once.

    ``loader.generator`` (every ``iter(loader)`` draws the workers' base seed from it, and
    ``shuffle=True`` shuffles with it) and the ``generator`` of its sampler and of its batch
    sampler's sampler. torchdata's ``RandomSampler`` owns one even when none was given.
    Their states are RNG state like the global one: a resume that does not restore them
    shuffles the following epochs differently (meta-pytorch/data#1437).
    """
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    # Under DDP Lightning wraps a sampler it cannot shard itself (torchdata's RandomSampler)
    # in a DistributedSamplerWrapper: the generator that shuffles is the wrapped sampler's.
    samplers += [distributed_wrapped_sampler(s) for s in samplers]
    unwrapped = [s.inner if isinstance(s, ResumableSampler) else s for s in samplers]
    candidates = [getattr(loader, "generator", None)] + [getattr(s, "generator", None) for s in unwrapped]
    return list({id(g): g for g in candidates if isinstance(g, torch.Generator)}.values())  # each once, in order


@dataclasses.dataclass(eq=False, repr=False)
class _RewindingSampler(Sampler[Any]):
    """``inner``, whose every ``iter()`` after the first runs from the states ``pre_iter`` and
    leaves the RNG states as it found them: what ``inner`` draws when iterated comes from the
    epoch-start states, and draws made between the calls (the worker base seed) are kept."""

    inner: Any
    generators: list[torch.Generator]
    pre_iter: dict[str, Any] | None
    calls: int = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        self.calls += 1
        if self.calls == 1 or self.pre_iter is None:
            return iter(self.inner)
        now = snapshot_iter_rng(self.generators)
        set_iter_rng(self.generators, self.pre_iter)
        try:
            return iter(self.inner)
        finally:
            set_iter_rng(self.generators, now)


@contextlib.contextmanager
def rewound_sampler(loader: Any, pre_iter: dict[str, Any]) -> Iterator[None]:
    """While a resumed StatefulDataLoader's iterator is made, make its sampler's draws repeat
    those of the epoch's start (torchdata iterates such a sampler up to three times then, and
    each ``iter()`` of a ``DistributedSamplerWrapper`` draws a new permutation)."""
    batch_sampler: Any = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    if batch_sampler is None or inner is None:
        yield
        return
    rewinding = _RewindingSampler(inner, loader_generators(loader), pre_iter)
    batch_sampler.sampler = rewinding  # read by the BatchSampler's iterator when it is made
    try:
        yield
    finally:
        batch_sampler.sampler = inner
        rewinding.pre_iter = None  # the live iterator keeps it: a later iter() is plain


class ResumableSampler(Sampler[int]):
    """Yields what ``inner`` yields, and can start an epoch after its first ``skip`` indices.

    ``inner`` is a ``SequentialSampler``, ``RandomSampler`` or ``DistributedSampler``.
    For a ``RandomSampler`` the epoch's permutation is fixed by a seed drawn from the
    global torch RNG (exactly the draw ``RandomSampler`` makes, at the same moment: the
    first ``next``) or by the state of its own generator; :attr:`epoch_state` records it
    so a resumed run replays the same permutation without drawing again.
    """

    def __init__(self, inner: Sampler[int], batch_size: int = 1,
                 generators: list[torch.Generator] | None = None) -> None:  # fmt: skip
        self.inner = inner
        self.batch_size = batch_size  # of the BatchSampler around it: skips are counted in batches
        self.epoch_state: tuple[str, Any] | None = None
        self.generators = list(generators or [])  # the loader's (see loader_generators)
        # (epoch, snapshot_iter_rng) taken just before the epoch's iterator was created: a
        # mid-epoch resume recreates worker iterators from it, so they get the same base seed.
        self.pre_iter: tuple[int, dict[str, Any]] | None = None
        self._resume: tuple[tuple[str, Any] | None, int] | None = None

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forward to ``inner`` (``DistributedSampler`` reshuffles per epoch); note the RNG states
        (before the epoch's iterator is made). Only the first call for an epoch counts:
        Lightning calls it twice (``DataLoader.sampler`` and ours)."""
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if self.pre_iter is None or self.pre_iter[0] != epoch:
            self.pre_iter = (epoch, snapshot_iter_rng(self.generators))

    def resume_at(self, epoch_state: tuple[str, Any] | None, skip: int) -> None:
        """Make the next epoch replay ``epoch_state`` and skip its first ``skip`` indices."""
        self._resume = (epoch_state, skip)

    def replay(self) -> int:
        """Yield the skipped indices too (their batches are dropped after loading); returns
        how many batches to drop. Call after :meth:`resume_at`."""
        if self._resume is None:
            return 0
        epoch_state, skip = self._resume
        self._resume = (epoch_state, 0)
        return skip // self.batch_size

    def __iter__(self) -> Iterator[int]:
        # A generator function, like RandomSampler.__iter__: nothing runs (and no random
        # number is drawn) before the first next(), which is when the original draws.
        resume, self._resume = self._resume, None
        skip = resume[1] if resume is not None else 0
        inner = self.inner
        if _is_plain(inner, RandomSampler):
            assert isinstance(inner, RandomSampler)
            state = resume[0] if resume is not None else None
            if state is None:
                if inner.generator is None:
                    state = ("seed", int(torch.empty((), dtype=torch.int64).random_().item()))
                else:
                    state = ("generator", inner.generator.get_state())
            self.epoch_state = state
            if state[0] == "seed":
                sampler = copy.copy(inner)
                sampler.generator = torch.Generator().manual_seed(int(state[1]))
                it: Iterator[int] = iter(sampler)
            else:
                if inner.generator is None:
                    inner.generator = torch.Generator()
                inner.generator.set_state(state[1])
                it = iter(inner)
        else:
            self.epoch_state = None
            it = iter(inner)
        yield from itertools.islice(it, skip, None)


def has_workers(loader: Any) -> bool:
    """``loader`` loads in worker processes (they draw from a base seed made by ``iter``)."""
    return int(getattr(loader, "num_workers", 0) or 0) > 0


def has_set_epoch(loader: Any) -> bool:
    """``loader``'s sampler (or its batch sampler's) takes ``set_epoch``."""
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    return any(callable(getattr(s, "set_epoch", None)) for s in samplers)


def is_stateful(value: Any) -> bool:
    """``value`` has ``state_dict`` and ``load_state_dict`` (a StatefulDataLoader, a sampler, a module…)."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def replays_sampler(loader: Any) -> bool:
    """A ``StatefulDataLoader`` that resumes by iterating its sampler again from the start.

    torchdata fast-forwards a sampler without ``state_dict`` (a new iterator, skipping what
    was yielded), so what it draws comes from the states at the resume, not the epoch start.
    Sequential and plain distributed samplers draw nothing.
    """
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    sampler = sampler if sampler is not None else getattr(loader, "sampler", None)
    if sampler is None or is_stateful(sampler):
        return False
    if type(sampler).__module__.startswith("torchdata."):  # its samplers' iterators save their state
        return False
    if type(sampler).__name__ == "_InfiniteConstantSampler":  # iterable datasets: no indices
        return False
    return not any(_is_plain(sampler, cls) for cls in (SequentialSampler, DistributedSampler))


def describe_loader(loader: Any) -> str:
    """``Loader(sampler=..., batch_sampler=...)``: how warnings name a loader."""
    sampler, batch_sampler = getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)
    return f"{type(loader).__name__}(sampler={type(sampler).__name__}, batch_sampler={type(batch_sampler).__name__})"


def wrap_loader(loader: Any) -> tuple[str, ResumableSampler | None]:
    """Install a :class:`ResumableSampler` in ``loader`` where that is safe.

    Returns ``(kind, sampler)`` with kind ``"stateful"`` (Lightning saves its state),
    ``"sampler"`` (wrapped) or ``"unsupported"`` (position cannot be resumed).
    """
    if is_stateful(loader):
        return "stateful", None
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return "unsupported", None
    batch_sampler = loader.batch_sampler
    if not _is_plain(batch_sampler, BatchSampler):
        return "unsupported", None
    assert isinstance(batch_sampler, BatchSampler)
    inner = batch_sampler.sampler
    if isinstance(inner, ResumableSampler):
        return "sampler", inner
    if not any(_is_plain(inner, cls) for cls in (SequentialSampler, RandomSampler, DistributedSampler)):
        return "unsupported", None
    assert isinstance(inner, Sampler)
    wrapped = ResumableSampler(inner, batch_size=int(batch_sampler.batch_size), generators=loader_generators(loader))
    # DataLoader forbids re-assigning its own sampler attributes, but BatchSampler reads
    # `self.sampler` when an epoch's iteration starts, so this takes effect from then on.
    # DataLoader.sampler stays the original: Lightning's set_epoch still reaches it.
    batch_sampler.sampler = wrapped
    return "sampler", wrapped
