"""``Splitter`` remembers a large all-tensor dict (a module's ``state_dict``) between saves
(issue 33: the split while training waits): whatever changed, each split equals a fresh one."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from lightning_preempt.format import TensorDict
from lightning_preempt.format.skeleton import NEXT_REF, Splitter, merge_checkpoint, split_checkpoint

N = 64


def _state(n: int = N, *, version: int = 1) -> dict[str, Any]:
    weights: OrderedDict[str, Any] = OrderedDict((f"w{i}", torch.full((3,), float(i))) for i in range(n))
    weights._metadata = {"": {"version": version}}  # type: ignore[attr-defined]
    return {"state_dict": weights, "optimizer_states": [{"state": {0: {"m": torch.ones(2)}}}], "epoch": 0}


def _same_as_fresh(splitter: Splitter, state: dict[str, Any]) -> dict[str, Any]:
    tensors, skeleton = splitter.split(state)
    fresh_tensors, fresh = split_checkpoint(state)
    assert list(tensors) == list(fresh_tensors) and all(tensors[k] is fresh_tensors[k] for k in tensors)
    assert skeleton == fresh
    merged = merge_checkpoint(skeleton, tensors)
    assert type(merged["state_dict"]) is OrderedDict
    assert merged["state_dict"]._metadata == state["state_dict"]._metadata
    assert list(merged["state_dict"]) == list(state["state_dict"])
    assert all(merged["state_dict"][k] is v for k, v in state["state_dict"].items() if isinstance(v, torch.Tensor))
    return skeleton


def test_the_same_keys_reuse_the_remembered_placeholders() -> None:
    splitter = Splitter()
    first = _same_as_fresh(splitter, _state())
    second = _same_as_fresh(splitter, _state())  # new tensors, the same keys
    assert second["state_dict"] is first["state_dict"]  # remembered, not walked again
    assert second["state_dict"] == TensorDict("state_dict", N, True, {"_metadata": {"": {"version": 1}}})
    assert second["optimizer_states"][0]["state"][0]["m"] == NEXT_REF  # small dicts: walked


def test_changed_keys_types_or_versions_are_walked_again() -> None:
    splitter = Splitter()
    base = _same_as_fresh(splitter, _state())
    fewer = _same_as_fresh(splitter, _state(N - 1))
    assert fewer["state_dict"] is not base["state_dict"]
    odd = _state()
    odd["state_dict"]["w0"] = None
    assert _same_as_fresh(splitter, odd)["state_dict"]["w0"] is None  # not a TensorDict then
    newer = _same_as_fresh(splitter, _state(version=2))
    assert base["state_dict"].attrs == {"_metadata": {"": {"version": 1}}}  # an earlier skeleton is not changed
    assert newer["state_dict"].attrs == {"_metadata": {"": {"version": 2}}}
    odd_attrs = _state()
    odd_attrs["state_dict"].__dict__["__odd"] = 1  # no TensorDict carries it: placeholders one by one
    assert type(_same_as_fresh(splitter, odd_attrs)["state_dict"]) is OrderedDict
    plain = _state()
    plain["state_dict"] = dict(plain["state_dict"])
    assert Splitter().split(plain)[1]["state_dict"].ordered is False
    splitter.split(plain)
    _same_as_fresh(splitter, _state())


def test_a_flat_key_taken_earlier_in_the_walk_is_renamed_as_a_fresh_split_does() -> None:
    splitter = Splitter()
    _same_as_fresh(splitter, _state())
    weights = _state()["state_dict"]
    state = {"state_dict/w5": torch.zeros(1), "state_dict": weights}  # walked first: takes "state_dict/w5"
    keys = ("state_dict/w5", "state_dict")
    tensors, skeleton = splitter.split(state, keys)
    fresh_tensors, fresh = split_checkpoint(state, keys)
    assert list(tensors) == list(fresh_tensors) and skeleton == fresh
    assert tensors["state_dict/w5#1"] is weights["w5"] and tensors["state_dict/w5"] is state["state_dict/w5"]
    _same_as_fresh(splitter, _state())  # and back
