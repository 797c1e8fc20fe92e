"""The Fabric front-end's data position at a resize (issue 32), in one process: each "rank"
is a :class:`~lightning_preempt.fabric.data.LoopData` over its own DistributedSampler split,
saved at a step boundary at 3 ranks and resumed at 2 as ``Preemption.iterate`` resumes it.
Every sample of the epoch is trained once over both, for a plain DataLoader and a
StatefulDataLoader (tests/e2e/test_fabric.py does the same with real Fabric ranks)."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
from reshard_loop import PLAIN_KINDS, make_loader

from lightning_preempt.fabric.data import LoopData

N, BATCH = 48, 4


def _run(
    kind: str, world: int, rank: int, saved: dict[str, Any] | None, stop: int | None
) -> tuple[list[int], Any, str | None]:
    """Train ``rank`` of ``world`` from ``saved`` until ``stop`` batches of the epoch (``None``:
    its end); the samples trained, the state captured at that boundary, how it resumed."""
    data = LoopData()
    data.load(copy.deepcopy(saved))
    captured: list[dict[str, Any]] = []

    def boundary() -> None:  # after the loop's work on a batch, as Preemption.step
        if data.batches_in_epoch == stop:
            captured.append(data.capture(rank=rank, world_size=world, step=stop))

    trained: list[int] = []
    loader = make_loader(kind, N, BATCH, world, rank)
    for (batch,) in data.iterate(loader, to_device=lambda b: b, max_epochs=1, rank=rank, world_size=world,
                                 boundary=boundary):  # fmt: skip
        if captured:
            break  # drawn after the save: not trained
        trained += batch.tolist()
    return trained, captured[0] if captured else None, data.restored


@pytest.mark.parametrize("kind", PLAIN_KINDS)
def test_an_epoch_saved_at_3_ranks_and_resumed_at_2_trains_every_sample_once(kind: str) -> None:
    seen: Counter[int] = Counter()
    states = []
    for rank in range(3):
        trained, state, _ = _run(kind, 3, rank, None, stop=2)
        seen.update(trained)
        states.append(state)
    assert sum(seen.values()) == 2 * BATCH * 3
    for rank in range(2):
        trained, _, restored = _run(kind, 2, rank, states[rank], stop=None)
        assert restored == "resharded"
        seen.update(trained)
    twice = {i: c for i, c in seen.items() if c > 1}
    assert set(seen) == set(range(N)) and not twice, f"missing {sorted(set(range(N)) - set(seen))}, twice {twice}"
