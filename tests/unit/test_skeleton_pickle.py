"""Tensor placeholders in the per-rank state pickle. Format 3: the keys as one string, in walk
order; a dict of tensors only is one ``TensorDict``, any other tensor the one ``NEXT_REF`` (one
REDUCE, then a memo reference each).
Skeletons written before (a ``TensorRef(key)`` each: one REDUCE each, and before that
NEWOBJ + BUILD) still load and merge."""

from __future__ import annotations

import io
import pickletools
from typing import Any

import pytest
import torch

from lightning_preempt.format import TensorDict, TensorRef
from lightning_preempt.format.pickles.unpickle import load_state_bytes
from lightning_preempt.format.skeleton import NEXT_REF, REFS_KEY, merge_checkpoint, split_checkpoint, tensor_refs

N = 300


def _state() -> dict[str, Any]:
    weights = {f"layer{i}.weight": torch.full((2,), float(i)) for i in range(N)}
    moments = {i: {"exp_avg": torch.full((1,), float(i)), "lr": 0.1} for i in range(N)}
    return {"state_dict": weights, "optimizer_states": [{"state": moments}], "global_step": 4}


def _format_2(state: dict[str, Any]) -> dict[str, Any]:
    """The skeleton as format 2 wrote it: a ``TensorRef`` naming its key in every place."""
    moments = {i: {"exp_avg": TensorRef(f"optimizer_states/0/state/{i}/exp_avg"), "lr": 0.1} for i in range(N)}
    weights = {k: TensorRef(f"state_dict/{k}") for k in state["state_dict"]}
    return {**state, "state_dict": weights, "optimizer_states": [{"state": moments}]}


def _saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _opcodes(archive: bytes) -> list[str]:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return [op.name for op, _, _ in pickletools.genops(pkl)]


def test_placeholders_pickle_as_one_object_and_the_keys_as_one_string() -> None:
    tensors, skeleton = split_checkpoint(_state())
    data = _saved(skeleton)
    ops = _opcodes(data)
    assert ops.count("REDUCE") == 2 and ops.count("BINGET") + ops.count("LONG_BINGET") >= N - 1
    loaded = load_state_bytes(data, path="test")
    assert loaded == skeleton and loaded["state_dict"] == TensorDict("state_dict", N, False, {})
    assert loaded["optimizer_states"][0]["state"][7]["exp_avg"] == NEXT_REF
    weights = [f"state_dict/layer{i}.weight" for i in range(N)]
    assert tensor_refs(loaded) == [*weights, *(f"optimizer_states/0/state/{i}/exp_avg" for i in range(N))] == list(tensors)
    merged = merge_checkpoint(loaded, tensors)
    assert REFS_KEY not in merged and merged["global_step"] == 4
    assert [float(t[0]) for t in merged["state_dict"].values()] == [float(i) for i in range(N)]
    assert [float(s["exp_avg"][0]) for s in merged["optimizer_states"][0]["state"].values()] == [float(i) for i in range(N)]


@pytest.mark.parametrize("pickling", ["reduce (format 2)", "newobj + build (before)"])
def test_skeletons_written_before_still_load(monkeypatch: pytest.MonkeyPatch, pickling: str) -> None:
    state = _state()
    tensors, _ = split_checkpoint(state)
    skeleton = _format_2(state)
    if pickling.startswith("newobj"):
        monkeypatch.delattr(TensorRef, "__reduce__")  # the dataclass's own pickling, as before
    old = _saved(skeleton)
    monkeypatch.undo()
    assert ("BUILD" in _opcodes(old)) == pickling.startswith("newobj")
    loaded = load_state_bytes(old, path="test")
    assert loaded == skeleton and tensor_refs(loaded) == list(tensors)
    merged = merge_checkpoint(loaded, tensors)
    assert all(merged["state_dict"][k] is tensors[f"state_dict/{k}"] for k in state["state_dict"])


def test_keys_holding_the_separator_are_listed_one_by_one() -> None:
    state = {"state_dict": {"a\nb": torch.ones(1), "c": torch.zeros(1)}}
    tensors, skeleton = split_checkpoint(state)
    assert skeleton[REFS_KEY] == ["state_dict/a\nb", "state_dict/c"]
    merged = merge_checkpoint(load_state_bytes(_saved(skeleton), path="test"), tensors)
    assert torch.equal(merged["state_dict"]["a\nb"], torch.ones(1)) and torch.equal(
        merged["state_dict"]["c"], torch.zeros(1)
    )


@pytest.mark.parametrize("refs", [["state_dict/x"], ["state_dict/x", "state_dict/y", "state_dict/z"], 7])
def test_placeholders_and_keys_that_do_not_pair_up_are_refused(refs: Any) -> None:
    _, skeleton = split_checkpoint({"state_dict": {"x": torch.ones(1), "y": torch.ones(1)}})
    with pytest.raises(ValueError, match=r"placeholders|tensor keys"):
        merge_checkpoint({**skeleton, REFS_KEY: refs}, {"state_dict/x": torch.ones(1), "state_dict/y": torch.ones(1),
                                                        "state_dict/z": torch.ones(1)})  # fmt: skip


def test_a_checkpoint_using_the_reserved_key_is_refused_with_a_hint() -> None:
    with pytest.raises(ValueError, match="HINT: rename"):
        split_checkpoint({REFS_KEY: 1, "state_dict": {}})


def test_the_light_cli_accepts_what_load_accepts() -> None:
    """``verify`` replays the weights-only unpickler without torch (format/pickles/check.py):
    a format-3 state passes there as it loads here."""
    from lightning_preempt.format.pickles.check import check_state_pickle

    _, skeleton = split_checkpoint(_state())
    check_state_pickle(_saved(skeleton), path="test")


@pytest.mark.parametrize(
    "args",
    [(7, N, False, {}), ("state_dict", -1, False, {}), ("state_dict", N, 1, {}), ("state_dict", N, True, {"__class__": 1})],
)
def test_a_tensor_dict_with_bad_arguments_is_a_corrupt_state(args: tuple[Any, ...]) -> None:
    from lightning_preempt.errors import CorruptCheckpointError

    class Forged:  # pickles as a TensorDict call with any arguments
        def __reduce__(self) -> tuple[Any, ...]:
            return (TensorDict, args)

    with pytest.raises(ValueError, match="TensorDict"):
        TensorDict(*args)
    with pytest.raises(CorruptCheckpointError):
        load_state_bytes(_saved({"state_dict": Forged(), REFS_KEY: []}), path="test")


def test_a_tensor_dict_whose_keys_are_not_its_own_is_refused() -> None:
    tensors, skeleton = split_checkpoint(_state())
    moved = {**skeleton, "state_dict": TensorDict("other", N, False, {})}
    with pytest.raises(ValueError, match="do not start with"):
        merge_checkpoint(moved, tensors)
    with pytest.raises(ValueError, match="more tensor placeholders"):
        merge_checkpoint({**skeleton, "state_dict": TensorDict("state_dict", 3 * N, False, {})}, tensors)
