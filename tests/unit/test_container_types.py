"""A checkpoint's containers come back as the exact types saved (issue 21, finding b):
``torch.Size``, namedtuples, tuple subclasses, ``OrderedDict`` with ``_metadata``,
``defaultdict`` — in the skeleton split/merge, and through the plugin's save and load."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from pathlib import Path
from typing import Any

import torch

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.format.pickles.unpickle import _map_tensors
from lightning_preempt.format.skeleton import merge_checkpoint, split_checkpoint

Pair = namedtuple("Pair", ["weight", "scale"])


class Shape(tuple):  # a tuple subclass without _fields, like torch.Size
    pass


def _state() -> dict[str, Any]:
    weights: OrderedDict[str, torch.Tensor] = OrderedDict(w=torch.arange(6.0).reshape(2, 3))
    weights._metadata = OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    counts: defaultdict[str, int] = defaultdict(int, {"a": 3})
    return {
        "state_dict": weights,
        "optimizer_states": [{"pair": Pair(torch.ones(2), 0.5), "shape": torch.Size([4, 5])}],
        "input_shape": torch.Size([3, 32, 32]),
        "shape": Shape((1, 2)),
        "counts": counts,
        "global_step": 7,
    }


def _check(loaded: dict[str, Any]) -> None:
    assert type(loaded["input_shape"]) is torch.Size and loaded["input_shape"].numel() == 3072
    assert type(loaded["shape"]) is Shape and loaded["shape"] == (1, 2)
    assert type(loaded["counts"]) is defaultdict and loaded["counts"]["missing"] == 0
    assert type(loaded["state_dict"]) is OrderedDict
    assert loaded["state_dict"]._metadata == {"": {"version": 2}}
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(6.0).reshape(2, 3))
    opt = loaded["optimizer_states"][0]
    assert type(opt["pair"]) is Pair and torch.equal(opt["pair"].weight, torch.ones(2)) and opt["pair"].scale == 0.5
    assert type(opt["shape"]) is torch.Size and opt["shape"] == (4, 5)


def test_split_merge_and_map_keep_container_types() -> None:
    tensors, skeleton = split_checkpoint(_state())
    assert set(tensors) == {"state_dict/w", "optimizer_states/0/pair/0"}  # namedtuple tensors are sharded too
    _check(merge_checkpoint(skeleton, tensors))
    _check(_map_tensors(_state(), lambda t: t.clone()))


def test_plugin_round_trip_keeps_container_types(tmp_path: Path) -> None:
    io = ShardedAsyncCheckpointIO(trust_checkpoints=True)  # the namedtuple class is the user's own
    io.save_checkpoint(_state(), str(tmp_path / "ck"))
    io.wait()
    _check(io.load_checkpoint(str(tmp_path / "ck")))
    io.teardown()
    plain = ShardedAsyncCheckpointIO()  # allow-listed types only: torch.Size comes back as torch.Size
    loaded = plain.load_checkpoint(str(tmp_path / "ck"), weights_only=False)
    assert type(loaded["input_shape"]) is torch.Size


def test_the_inline_split_is_the_generic_walk() -> None:
    """split_checkpoint walks plain dicts and lists itself (speed, issue 26): the same keys
    in the same order and the same skeleton as the generic map_leaves walk."""
    from lightning_preempt.format.skeleton import NEXT_REF, REFS_KEY, map_leaves

    t = torch.ones(2)
    state = _state()
    state["optimizer_states"].append({0: t, "0": t, "nested": [[t, 1, (t, "x")], {"p": torch.nn.Parameter(t)}]})
    state["state_dict"]["x"] = [t, {"y": t}]
    tensors, skeleton = split_checkpoint(state)
    expected: dict[str, torch.Tensor] = {}

    def extract(leaf: Any, key: str) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        n, unique = 1, key
        while unique in expected:
            unique, n = f"{key}#{n}", n + 1
        expected[unique] = leaf
        return NEXT_REF

    generic = {k: map_leaves(v, extract, k) if k in ("state_dict", "optimizer_states") else v for k, v in state.items()}
    assert list(tensors) == list(expected) and all(tensors[k] is expected[k] for k in expected)
    assert skeleton == {**generic, REFS_KEY: "\n".join(expected)}
    assert type(skeleton["state_dict"]) is OrderedDict and skeleton["state_dict"]._metadata == {"": {"version": 2}}


def test_a_module_state_dict_is_split_inline_and_restored() -> None:
    """A ``Module.state_dict()`` (an ``OrderedDict``) is walked inline (issue 33: 16 -> 2.5 ms
    at 4000 tensors): its values, order and ``_metadata`` come back, the original untouched."""
    from lightning_preempt.format.skeleton import merge_checkpoint

    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    weights = module.state_dict()
    tensors, skeleton = split_checkpoint({"state_dict": weights, "epoch": 1})
    assert type(skeleton["state_dict"]) is OrderedDict and skeleton["state_dict"] is not weights
    assert list(tensors) == [f"state_dict/{k}" for k in weights]
    assert all(isinstance(v, torch.Tensor) for v in weights.values())  # the original keeps its tensors
    restored = merge_checkpoint(skeleton, {k: v.clone() for k, v in tensors.items()})["state_dict"]
    assert type(restored) is OrderedDict and list(restored) == list(weights)
    assert restored._metadata == weights._metadata  # type: ignore[attr-defined]
    assert all(torch.equal(restored[k], weights[k]) for k in weights)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh.load_state_dict(restored)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), weights.values(), strict=True))
