"""resume/loaders.py and resume/exact_state.py without a Trainer: a hand-written loop drives them.

Each test trains part of an epoch with real loaders, saves what a front-end saves
(:meth:`ResumableLoaders.capture`, the RNG states, a StatefulDataLoader's own position),
then "restarts": other global RNG states, new loader objects, a new ``ResumableLoaders``,
and the restore in the documented call order. The resumed loop must train exactly the
rest of the epoch and the next epoch, and end with bit-identical RNG and generator states.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_preempt.resume import exact_state
from lightning_preempt.resume.exact_state import capture_rng, derive_seed, restore_rng
from lightning_preempt.resume.loaders import ResumableLoaders, drop_replayed
from lightning_preempt.resume.samplers import ResumableSampler, loader_generators

N, BATCH = 40, 4
REPLAY_SETTING = "loop.replay_worker_draws"


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Index and a draw from the RNG of the process that loads it (a worker's, with workers)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(i), torch.rand(())


class EagerSampler(Sampler[int]):
    """No ``state_dict``, draws its permutation at every ``iter`` (like Lightning's
    ``DistributedSamplerWrapper``): torchdata resumes it by iterating it again."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """What a loop does at each epoch start (Lightning's ``_set_sampler_epoch``: each sampler once)."""
    samplers = {id(s): s for s in (getattr(loader.batch_sampler, "sampler", None), loader.sampler) if s is not None}
    for sampler in samplers.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def data() -> TensorDataset:
    return TensorDataset(torch.arange(N))


LOADERS: dict[str, Callable[[], Any]] = {
    "random": lambda: DataLoader(data(), batch_size=BATCH, shuffle=True),
    "random-generator": lambda: DataLoader(
        data(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
    ),
    "random-replacement": lambda: DataLoader(
        data(), batch_size=BATCH, sampler=RandomSampler(data(), replacement=True, num_samples=N)
    ),
    "sequential": lambda: DataLoader(data(), batch_size=BATCH),
    "distributed": lambda: DataLoader(
        data(), batch_size=BATCH, sampler=DistributedSampler(data(), num_replicas=2, rank=1, seed=3)
    ),
    "stateful-generator": lambda: StatefulDataLoader(
        data(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(5)
    ),
    "stateful": lambda: StatefulDataLoader(data(), batch_size=BATCH, shuffle=True),
    # torchdata builds the resumed epoch's indices before the loop sets the epoch
    "stateful-distributed": lambda: StatefulDataLoader(
        data(), batch_size=BATCH, sampler=DistributedSampler(data(), num_replicas=2, rank=0, seed=3)
    ),
    "stateful-replaying": lambda: _replaying(torch.Generator().manual_seed(7)),
}


def _replaying(g: torch.Generator) -> StatefulDataLoader[Any]:
    return StatefulDataLoader(data(), batch_size=BATCH, sampler=EagerSampler(N, g), generator=g)


class Loop:
    """One loader and its bookkeeping, as a hand-written training loop (a Fabric front-end) holds them.

    Like Lightning's, the loop makes the epoch's iterator as soon as it starts; a restore
    then makes it again where needed (``make_iterators``).
    """

    def __init__(self, make: Callable[[], Any], position: dict[str, Any] | None = None, epoch: int = 0) -> None:
        self.loader = make()
        if position is not None:
            self.loader.load_state_dict(position)  # a StatefulDataLoader's own state (Lightning saves it)
        self.book = ResumableLoaders(replay_setting=REPLAY_SETTING)
        self.epoch = epoch
        self.iterator = iter(self.loader)
        self.book.wrap([self.loader])
        self.exact_positions: bool | None = None  # what restore_positions returned

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_sampler_epoch(self.loader, epoch)
        self.book.note_epoch_start([self.loader], epoch)
        self.iterator = iter(self.loader)

    def remake(self) -> None:
        self.iterator = iter(self.loader)

    def train(self, batches: int | None = None) -> list[list[int]]:
        """Sample indices of each batch; every step draws from the global RNG (dropout)."""
        out = []
        for batch in self.iterator:
            out.append(batch[0].tolist())
            torch.rand(2)
            if batches is not None and len(out) == batches:
                break
        return out

    def save(self, batches: int) -> dict[str, Any]:
        state = {
            "loaders": self.book.capture([self.loader], self.epoch),
            "rng": capture_rng(),
            "batches_in_epoch": batches,
        }
        if isinstance(self.loader, StatefulDataLoader):
            state["position"] = self.loader.state_dict()
        return state

    def generator_states(self) -> list[torch.Tensor]:
        return [g.get_state() for g in loader_generators(self.loader)]


def resume_mid_epoch(make: Callable[[], Any], saved: dict[str, Any], epoch: int, *, replay: bool = False) -> Loop:
    """A new process resumes inside ``epoch``, in the call order of resume/loaders.py."""
    torch.manual_seed(12345)  # a new process: other global RNG states
    loop = Loop(make, saved.get("position"), epoch)
    set_sampler_epoch(loop.loader, epoch)
    entries, loaders = saved["loaders"], [loop.loader]
    loop.exact_positions = loop.book.restore_positions(entries, True, saved["batches_in_epoch"])
    loop.book.set_pre_iter_rng(loaders, entries)
    to_drop = loop.book.remake_iterators(
        loaders,
        epoch,
        loop.remake,
        lambda dl: set_sampler_epoch(dl, epoch),
        mid_epoch=True,
        replay_worker_draws=replay,
    )
    drop_replayed([loop.iterator], to_drop)
    restore_rng(saved["rng"])
    loop.book.restore_generators(loaders, entries)
    return loop


def run_reference(make: Callable[[], Any], save_at: int) -> tuple[dict[str, Any], list[list[int]], Loop]:
    """Epoch 0 whole, epoch 1 to ``save_at`` (saved there), then the rest of epoch 1 and epoch 2."""
    torch.manual_seed(0)
    loop = Loop(make)
    loop.start_epoch(0)
    loop.train()
    loop.start_epoch(1)
    loop.train(save_at)
    saved = loop.save(save_at)
    rest = loop.train()
    loop.start_epoch(2)
    return saved, rest + loop.train(), loop


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_fresh_loop_trains_exactly_the_rest_of_the_epoch_and_the_next(kind: str) -> None:
    saved, expected, ref = run_reference(LOADERS[kind], save_at=3)
    ref_rng, ref_generators = torch.get_rng_state(), ref.generator_states()

    loop = resume_mid_epoch(LOADERS[kind], saved, epoch=1)
    assert loop.exact_positions, "each kind resumes its position and order (no 'not resumable' warning)"
    got = loop.train()
    loop.start_epoch(2)
    got += loop.train()
    assert got == expected
    assert torch.equal(torch.get_rng_state(), ref_rng), "the global RNG ends where it did uninterrupted"
    generators = loop.generator_states()
    assert len(generators) == len(ref_generators)
    assert all(torch.equal(a, b) for a, b in zip(generators, ref_generators, strict=True))


def test_capture_is_one_entry_per_loader_with_the_saved_keys() -> None:
    """The entry format of FORMAT_VERSION 1: old checkpoints hold these keys but "order"
    (added by issue 22, read with .get: an entry without it restores as before)."""
    torch.manual_seed(0)
    loop = Loop(LOADERS["random-generator"])
    loop.start_epoch(0)
    loop.train(2)
    (entry,) = loop.book.capture([loop.loader], 0)
    assert set(entry) == {"kind", "epoch_state", "generators", "pre_iter", "order"}
    assert entry["order"] is None, "only a distributed sampler's order is recorded"
    old = {k: v for k, v in entry.items() if k != "order"}
    assert loop.book.reshard([loop.loader], [old], 0, 2) == set()
    assert entry["kind"] == "sampler" and loop.book.kinds == ["sampler"]
    assert entry["epoch_state"][0] == "generator", "a RandomSampler with a generator records the generator's state"
    (g,) = loader_generators(loop.loader)
    assert len(entry["generators"]) == 1 and torch.equal(entry["generators"][0], g.get_state())
    assert set(entry["pre_iter"]) == {"torch", "generators"}
    (noted,) = loop.book.capture([loop.loader], 1)
    assert noted["pre_iter"] is None, "states noted for another epoch are not saved"


def test_a_stateful_loader_notes_its_pre_iterator_states_once_per_epoch() -> None:
    torch.manual_seed(0)
    loop = Loop(LOADERS["stateful-generator"])
    assert loop.book.kinds == ["stateful"]
    before = torch.get_rng_state()
    loop.book.note_epoch_start([loop.loader], 0)
    torch.rand(3)
    loop.book.note_epoch_start([loop.loader], 0)  # a second call in the same epoch keeps the first note
    (entry,) = loop.book.capture([loop.loader], 0)
    assert torch.equal(entry["pre_iter"]["torch"], before)
    assert entry["epoch_state"] is None


def test_workers_replay_the_trained_batches_so_their_draws_match() -> None:
    """Workers draw in ``__getitem__``: with replay they load the trained batches again (dropped)."""

    def make() -> DataLoader[Any]:
        return DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2)

    def values(loop: Loop) -> list[tuple[list[int], list[float]]]:
        return [(i.tolist(), v.tolist()) for i, v in loop.iterator]

    torch.manual_seed(0)
    ref = Loop(make)
    ref.start_epoch(0)
    ref.train(2)
    saved = ref.save(2)
    expected = values(ref)

    loop = resume_mid_epoch(make, saved, epoch=0, replay=True)
    assert values(loop) == expected, "same indices and bit-identical worker draws"


def test_workers_without_replay_are_warned_with_the_front_ends_setting() -> None:
    torch.manual_seed(0)
    make = lambda: DataLoader(Noisy(), batch_size=4, num_workers=1)  # noqa: E731
    ref = Loop(make)
    ref.start_epoch(0)
    ref.train(1)
    saved = ref.save(1)
    with pytest.warns(UserWarning, match="resuming mid-epoch with worker processes") as caught:
        loop = resume_mid_epoch(make, saved, epoch=0)
    assert any(f"set {REPLAY_SETTING} = True" in str(w.message) for w in caught)
    rest = [b[0].tolist() for b in loop.iterator]
    assert rest == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]


def test_unsupported_loaders_are_warned_once_and_is_current_follows_the_objects() -> None:
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(4)

    book = ResumableLoaders()
    first = [DataLoader(Stream()), DataLoader(data())]
    with pytest.warns(UserWarning, match="cannot resume the position of the training data DataLoader") as caught:
        book.wrap(first)
    assert len(caught) == 1 and "HINT:" in str(caught[0].message)
    assert book.kinds == ["unsupported", "sampler"]
    assert book.is_current(first) and not book.is_current([first[0], DataLoader(data())])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        book.wrap([DataLoader(Stream())])  # given once per process
    assert not book.is_current(first)


def test_restore_positions_is_exact_only_when_every_loader_resumes_its_saved_order() -> None:
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(4)

    def book_of(*loaders: Any) -> ResumableLoaders:
        book = ResumableLoaders()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unsupported-loader warning (tested above)
            book.wrap(list(loaders))
        return book

    shuffled = DataLoader(data(), batch_size=BATCH, shuffle=True)
    saved = book_of(shuffled).capture([shuffled], 0)
    assert book_of(DataLoader(data(), batch_size=BATCH, shuffle=True)).restore_positions(saved, True, 2)
    assert not book_of(DataLoader(data(), batch_size=BATCH, shuffle=True)).restore_positions(saved, False)
    # a loader whose position is not saved, or one saved when its order was not recorded
    mixed = [DataLoader(Stream()), DataLoader(data(), batch_size=BATCH)]
    assert not book_of(*mixed).restore_positions([{"kind": "unsupported"}, saved[0]], True, 2)
    assert not book_of(DataLoader(data(), batch_size=BATCH)).restore_positions([{"kind": "unsupported"}], True, 2)


def test_restore_positions_warns_when_the_number_of_loaders_changed(caplog: pytest.LogCaptureFixture) -> None:
    book = ResumableLoaders()
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    book.wrap([loader])
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
        assert not book.restore_positions([], mid_epoch=False)
        assert caplog.messages == [], "an epoch-end resume has no position to lose"
        assert not book.restore_positions([], mid_epoch=True, batches_in_epoch=3)
    assert caplog.messages == ["lightning_preempt: 1 training loaders now, 0 when saved: not resuming their positions"]
    sampler = getattr(loader.batch_sampler, "sampler", None)
    assert isinstance(sampler, ResumableSampler) and sampler.replay() == 0, "no position was set"


def test_restore_generators_keeps_them_when_the_counts_differ(caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True, generator=g)
    book = ResumableLoaders()
    book.wrap([loader])
    before = g.get_state()
    entry = {"kind": "sampler", "epoch_state": None, "generators": [before, before], "pre_iter": None}
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
        book.restore_generators([loader], [entry])
    assert torch.equal(g.get_state(), before)
    assert len(caplog.messages) == 1 and "has 1 torch generators, the checkpoint 2" in caplog.messages[0]


def test_epoch_end_restore_makes_the_next_epochs_iterator_from_the_saved_states() -> None:
    """A save that ended an epoch: restore the RNG, then make the next epoch's iterator."""
    make = LOADERS["random-generator"]
    torch.manual_seed(0)
    ref = Loop(make)
    ref.start_epoch(0)
    ref.train()
    saved = ref.save(10)
    ref.start_epoch(1)
    expected = ref.train()
    ref_rng = torch.get_rng_state()

    torch.manual_seed(12345)
    loop = Loop(make, epoch=1)
    made: list[int] = []

    def make_iterators() -> None:
        made.append(1)
        loop.remake()

    loop.book.restore_positions(saved["loaders"], False)
    restore_rng(saved["rng"])
    loop.book.restore_generators([loop.loader], saved["loaders"])
    loop.book.make_next_epoch_iterators([loop.loader], 1, make_iterators, lambda dl: set_sampler_epoch(dl, 1))
    assert made == [1]
    assert loop.train() == expected
    assert torch.equal(torch.get_rng_state(), ref_rng)


# ---- exact_state ---------------------------------------------------------------------------
def test_make_state_has_the_format_1_keys() -> None:
    state = exact_state.make_state(
        rank=1, world_size=2, epoch=3, global_step=40, batches_in_epoch=4, loaders=[], metrics={}, results={}
    )
    assert exact_state.STATE_KEY == "lightning_preempt" and exact_state.FORMAT_VERSION == 1
    assert list(state) == [
        "version",
        "rank",
        "world_size",
        "epoch",
        "global_step",
        "batches_in_epoch",
        "rng",
        "loaders",
        "metrics",
        "results",
        "accumulate",  # issue 22 (read with .get: older states lack it)
        "ddp_buckets",  # DDP's rebuilt bucket layout (read with .get: older states lack it)
    ]
    assert state["version"] == 1 and torch.equal(state["rng"]["torch"], torch.get_rng_state())
    assert exact_state.checked(state) is state


def test_checked_ignores_another_version_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
        assert exact_state.checked({"version": 2}) is None
        assert exact_state.checked(None) is None
    assert caplog.messages == [
        "lightning_preempt: exact-resume state version 2 is not 1; ignoring it (the resume is not exact)"
    ]


@pytest.mark.parametrize(
    ("saved_epoch", "batches", "num_batches", "expected"),
    [(2, 4, 10, True), (2, 10, 10, False), (2, 0, 10, False), (1, 4, 10, False), (2, 4, float("inf"), True)],
)
def test_is_mid_epoch(saved_epoch: int, batches: int, num_batches: float, expected: bool) -> None:
    state = {"epoch": saved_epoch, "batches_in_epoch": batches}
    assert exact_state.is_mid_epoch(state, 2, num_batches) is expected
    assert exact_state.is_mid_epoch(None, 2, num_batches) is False


def test_a_rank_without_saved_state_is_seeded_from_the_saving_ranks(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(4)
    state: dict[str, Any] = {"rank": 0, "world_size": 1, "rng": capture_rng()}
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
        exact_state.seed_from_saved_rank(state, 1)
    got = torch.rand(3)
    torch.manual_seed(derive_seed(state["rng"], 1))
    assert torch.equal(got, torch.rand(3))
    assert caplog.messages == [
        f"lightning_preempt: rank 1 has no saved RNG state (the checkpoint had 1 ranks); seeding it with "
        f"{derive_seed(state['rng'], 1)}, derived from rank 0's state"
    ]


def test_metric_states_are_restored_and_missing_ones_named(caplog: pytest.LogCaptureFixture) -> None:
    import torchmetrics

    from lightning_preempt.resume.exact_state import metric_states

    trained, fresh = torchmetrics.MeanSquaredError(), torchmetrics.MeanSquaredError()
    trained(torch.ones(2), torch.zeros(2))
    saved = metric_states(torch.nn.ModuleDict({"mse": trained}))
    state = {"metrics": {**saved, "gone": {"states": {}, "update_count": 0}}}
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
        exact_state.restore_metrics(torch.nn.ModuleDict({"mse": fresh}), state)
    assert torch.equal(fresh.compute(), trained.compute()) and fresh.compute().item() == 1.0
    assert caplog.messages == ["lightning_preempt: saved metric states not found in the model: ['gone']"]
