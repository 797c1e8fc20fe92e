"""Sample-exact resharding (issue 22): an epoch begun at one world size goes on at another and
every sample of it is trained once. The ranks run one after the other in this process
(``reshard_loop.stretch``, a hand-written loop over the neutral pieces); the same with real
gloo ranks is ``tests/multiproc/test_reshard_multirank.py``, with torchrun and the Trainer
``tests/e2e/test_elastic.py::test_elastic_resizes_train_every_sample_of_an_epoch_once``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from reshard_loop import KINDS, make_loader, stretch

from lightning_preempt.resume.reshard import ReshardedSampler, share


def _phase(kind: str, n: int, world: int, saved: list[dict[str, Any]] | None, epoch: int, stop: int | None,
           drop_last: bool = False) -> tuple[list[int], list[dict[str, Any]]]:  # fmt: skip
    trained: list[int] = []
    states = []
    for rank in range(world):
        own = None if saved is None else saved[rank] if rank < len(saved) else saved[0]  # a new rank reads rank 0's
        idx, state = stretch(kind, n, 4, world, rank, own, epoch, stop, drop_last=drop_last)
        trained += idx
        states.append(state)
    return trained, states


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("worlds", [(2, 1, 2), (3, 2, 4), (4, 3, 1)])
def test_every_sample_once_across_resizes(kind: str, worlds: tuple[int, int, int]) -> None:
    """48 samples, batches of 4; two resizes inside epoch 1, then epoch 2 in full at the last size."""
    n = 48
    a, states = _phase(kind, n, worlds[0], None, 1, 2)
    b, states = _phase(kind, n, worlds[1], states, 1, 1)
    c, states = _phase(kind, n, worlds[2], states, 1, None)
    seen = Counter(a + b + c)
    padding = len(a + b + c) - n
    assert set(seen) == set(range(n)), f"missing {sorted(set(range(n)) - set(seen))}"
    # Padding (DistributedSampler's, from the order's first indices) only where the rest does not split evenly.
    assert padding == (-(n - len(a + b)) % worlds[2]) and sum(v - 1 for v in seen.values()) == padding
    # The next epoch is the samplers' own split again (the originals are back).
    d, _ = _phase(kind, n, worlds[2], None, 2, None)
    plain = [i for r in range(worlds[2]) for (batch,) in _epoch(kind, n, worlds[2], r, 2) for i in batch.tolist()]
    assert d == plain and sorted(d)[:n] == sorted(range(n))[: len(d)]


def _epoch(kind: str, n: int, world: int, rank: int, epoch: int) -> Any:
    loader = make_loader(kind, n, 4, world, rank)
    loader.sampler.set_epoch(epoch)
    return list(loader)


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_world_size_is_not_resharded(kind: str) -> None:
    """A resume at the saved split keeps today's bit-identical path (positions restored as saved)."""
    from lightning_preempt.resume.loaders import ResumableLoaders

    _, states = _phase(kind, 48, 2, None, 0, 2)
    loader = make_loader(kind, 48, 4, 2, 1)
    loaders = ResumableLoaders()
    loaders.wrap([loader])
    assert loaders.reshard([loader], states[1]["loaders"], 0, 2) == set()
    assert not isinstance(loader.batch_sampler.sampler, ReshardedSampler)
    order = states[1]["loaders"][0]["order"]
    assert order["consumed"] == 2 * 4 * 2 and order["n"] == 48 and not order["resharded"]


def test_drop_last_cuts_at_most_world_minus_one_per_split() -> None:
    n = 50
    a, states = _phase("dataloader", n, 2, None, 0, 2, drop_last=True)
    b, _ = _phase("dataloader", n, 3, states, 0, None, drop_last=True)
    seen = Counter(a + b)
    assert max(seen.values()) == 1, "never twice"
    assert n - len(seen) == (n - 16) % 3  # 34 left over 3 ranks: 1 cut


def test_share_splits_like_distributed_sampler() -> None:
    """No resize (nothing consumed, same split): exactly DistributedSampler's indices, padding included."""
    import torch
    from torch.utils.data import DistributedSampler

    for n, world in [(10, 3), (12, 4), (7, 2)]:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
        for rank in range(world):
            ds = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)  # type: ignore[arg-type]
            assert share(order, 0, world, rank, False) == [order[i] for i in ds]


def test_another_dataset_length_is_not_resharded_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from lightning_preempt.resume.loaders import ResumableLoaders

    _, states = _phase("dataloader", 48, 2, None, 0, 2)
    loader = make_loader("dataloader", 40, 4, 1, 0)
    loaders = ResumableLoaders()
    loaders.wrap([loader])
    with caplog.at_level("WARNING"):
        assert loaders.reshard([loader], states[0]["loaders"], 0, 2) == set()
    assert "orders epoch 0 otherwise than when saved" in caplog.text


def test_global_batch_per_rank_or_kept_where_it_divides(caplog: pytest.LogCaptureFixture) -> None:
    from lightning_preempt.resume.exact_state import accumulation_at

    saved = {"world_size": 2, "accumulate": 1}
    with caplog.at_level("WARNING"):
        assert accumulation_at(saved, 1, 1, "per_rank") == 1
        assert "the global batch changes by 1/2" in caplog.text
        assert accumulation_at(saved, 1, 1, "keep") == 2  # 2 ranks x 1 -> 1 rank x 2
        assert "accumulate_grad_batches 1 -> 2" in caplog.text
        assert accumulation_at({"world_size": 1, "accumulate": 2}, 2, 1, "keep") == 1  # and back
        assert accumulation_at({"world_size": 1, "accumulate": 2}, 1, 1, "keep") == 2  # a restart at 1 keeps it
        caplog.clear()
        assert accumulation_at({"world_size": 2, "accumulate": 1}, 3, 1, "keep") == 1  # 2/3: does not divide
        assert "not a whole number of accumulations at 3 ranks" in caplog.text


def test_global_batch_option_is_validated() -> None:
    from lightning_preempt.engine.config import PreemptionConfig

    with pytest.raises(ValueError, match="global_batch must be 'per_rank' or 'keep'") as err:
        PreemptionConfig(dirpath="x", global_batch="constant")  # type: ignore[arg-type]
    assert "HINT:" in str(err.value)


class _SignalsItself(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each sample load sends SIGTERM to the loading process (a worker), as a group-wide
    SIGTERM from torchrun's agent or SLURM reaches it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
        return i


def test_loader_workers_outlive_the_preemption_signal() -> None:
    """Without the shield torch's SIGTERM handler ends the worker and the trainer's next fetch
    fails ("DataLoader worker ... is killed by signal: Terminated") before any snapshot."""
    import signal

    from torch.utils.data import DataLoader

    from lightning_preempt.preemption.signals import IgnoreSignals, shield_workers

    calls: list[int] = []
    loader = DataLoader(_SignalsItself(), batch_size=2, num_workers=1, worker_init_fn=calls.append)
    assert shield_workers([loader, DataLoader(_SignalsItself())], [signal.SIGTERM]) == 1, "loaders with workers"
    assert isinstance(loader.worker_init_fn, IgnoreSignals) and loader.worker_init_fn.inner == calls.append
    assert shield_workers([loader], [signal.SIGTERM]) == 0, "once"
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
