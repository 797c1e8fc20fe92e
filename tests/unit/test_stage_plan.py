"""HostStager.stage reuses its last routing while the save's structure key (format/structure.py:
the tensors' keys, types, shapes, dtypes and devices) is the one it routed for, and every
change makes a new key."""

from __future__ import annotations

import pytest
import torch

from lightning_preempt.format import structure
from lightning_preempt.format.structure import Structures
from lightning_preempt.staging.stager import HostStager


def _state(n: int = 50, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(3, i + 1, generator=g) for i in range(n)}


def _check(staged: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    assert list(staged) == list(source)
    for key, tensor in source.items():
        assert staged[key].shape == tensor.shape and staged[key].dtype == tensor.dtype
        assert torch.equal(staged[key], tensor), key
        assert staged[key].data_ptr() != tensor.data_ptr()  # a copy, not the training tensor


def test_second_stage_reuses_the_buffers_and_copies_new_values() -> None:
    stager, structures = HostStager(pin_memory=False), Structures()
    state = _state()
    first = stager.stage(state, key=structures.key(state))
    _check(first, state)
    assert stager._plan is not None
    for t in state.values():
        t.add_(1.0)  # training changed the values in place
    assert stager.unchanged(state, structures.key(state))
    second = stager.stage(state, key=structures.key(state))
    _check(second, state)
    assert all(second[k] is first[k] for k in state)  # the same buffers
    assert stager.last_staged_bytes == sum(t.nbytes for t in state.values())


@pytest.mark.parametrize("check", ["C++ guard", "Python signature"])
def test_every_structural_change_is_noticed(check: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if check == "Python signature":  # a torch without TorchDynamo's TensorGuards
        monkeypatch.setattr(structure, "_guard", lambda values: None)
    stager, structures = HostStager(pin_memory=False), Structures()
    state = _state()
    key = structures.key(state)
    stager.stage(state, key=key)
    assert key.guarded == (check == "C++ guard")
    same = {k: v.clone() for k, v in state.items()}
    assert structures.key(same) is key and stager.unchanged(same, key)
    changed = {
        "shape": {**state, "p3": torch.ones(5, 5)},
        "broadcastable shape": {**state, "p3": state["p3"][:1].clone()},  # a copy would broadcast silently
        "dtype": {**state, "p3": state["p3"].double()},
        "new key": {**state, "extra": torch.full((2,), 7.0)},
        "key gone": {k: v for k, v in state.items() if k != "p0"},
        "order": dict(reversed(list(state.items()))),
    }
    for what, new in changed.items():
        structures.key(state)  # (the last key is the unchanged state's)
        new_key = structures.key(new)
        assert new_key is not key and not stager.unchanged(new, new_key), what
        staged = stager.stage(new, key=new_key)
        _check(staged, new)
        if what == "key gone":
            assert "p0" not in stager._buffers, what  # its buffer freed, as without the plan
        assert structures.key(new) is new_key and stager.unchanged(new, new_key), what
        again = stager.stage(new, key=new_key)  # and the plan for the new structure is reused
        _check(again, new)
        assert all(again[k] is staged[k] for k in new), what


def test_keep_and_pinned_arguments_are_part_of_the_plan() -> None:
    stager = HostStager(pin_memory=False)
    state = _state(5)
    stager.stage(state, keep=("x",))
    first = stager._plan
    stager.stage(state)
    assert stager._plan is not first  # a different keep: routed again
    _check(stager.stage(state, pinned=set()), state)


def test_share_memo_recomputes_on_every_new_key_and_agrees_with_own_share() -> None:
    from lightning_preempt.format.shares import ShareMemo, own_share, replica_fingerprint

    memo, structures = ShareMemo(), Structures()
    state = _state(40)
    for world in (2, 3):
        for rank in range(world):
            fingerprint, got = memo.share(state, rank, world, structures.key(state))
            assert fingerprint == replica_fingerprint(state) and list(got) == list(own_share(state, rank, world))
    for new in ({**state, "p3": torch.ones(9, 9)}, {**state, "p3": state["p3"][:1].clone()},
                {**state, "p3": state["p3"].half()}, {**state, "x": torch.ones(1)}):  # fmt: skip
        for rank in range(2):
            fingerprint, got = memo.share(new, rank, 2, structures.key(new))
            assert list(got) == list(own_share(new, rank, 2))
            assert fingerprint == replica_fingerprint(new) != replica_fingerprint(state)
    key = structures.key(state)
    assert memo.share(state, 0, 1, key) == (replica_fingerprint(state), state)
    # ranks that differ: every rank stages all, until the fingerprints agree again
    assert memo.agreed([b"x", b"x"]) and not memo.agreed([b"x", b"y"])
    assert memo.share(state, 0, 2, key)[1] is state
    assert memo.agreed([b"x", b"x"]) and list(memo.share(state, 0, 2, key)[1]) == list(own_share(state, 0, 2))
