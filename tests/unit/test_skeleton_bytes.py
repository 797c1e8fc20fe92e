"""The skeleton's archive without torch's per-object ``persistent_id`` call: ``torch.save``'s
bytes exactly, with and without tensors left in the skeleton."""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any

import torch

from lightning_preempt.format import TensorRef
from lightning_preempt.format.pickles.unpickle import load_state_bytes
from lightning_preempt.write.skeleton_bytes import skeleton_bytes


def _torch_save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _skeleton(extra: Any) -> dict[str, Any]:
    refs = OrderedDict((f"layer.{i}.weight", TensorRef(f"state_dict/layer.{i}.weight")) for i in range(300))
    return {
        "epoch": 3,
        "global_step": 120,
        "state_dict": refs,
        "optimizer_states": [
            {
                "state": {i: {"exp_avg": TensorRef(f"o/{i}")} for i in range(50)},
                "param_groups": [{"lr": 0.1, "params": list(range(50))}],
            }
        ],
        "callbacks": {"cb": extra},
        "hparams": {"name": "x", "sizes": (1, 2.5, None, b"raw")},
    }


def test_a_skeleton_without_tensors_is_torch_saves_bytes() -> None:
    skeleton = _skeleton({"best": 0.25})
    assert skeleton_bytes(skeleton) == _torch_save(skeleton)


def test_tensors_left_in_the_skeleton_are_saved_as_torch_saves_them() -> None:
    rng = torch.get_rng_state()
    shared = torch.arange(6.0)
    with_storage = _skeleton({"a": shared, "storage": torch.arange(4, dtype=torch.uint8).untyped_storage()})
    assert skeleton_bytes(with_storage) == _torch_save(with_storage)
    skeleton = _skeleton({"rng": rng, "a": shared, "view": shared[2:4]})
    data = skeleton_bytes(skeleton)
    assert data == _torch_save(skeleton)
    loaded = load_state_bytes(data, path="skeleton")  # our weights-only loader
    cb = loaded["callbacks"]["cb"]
    assert torch.equal(cb["rng"], rng) and torch.equal(cb["view"], shared[2:4])
    assert cb["view"].untyped_storage().data_ptr() == cb["a"].untyped_storage().data_ptr()  # one storage, as saved
    assert loaded["state_dict"]["layer.7.weight"] == TensorRef("state_dict/layer.7.weight")
