"""Tensor placeholders in the per-rank state pickle: one REDUCE each (cheap to write and to
load with weights_only), and skeletons written before that (NEWOBJ + BUILD) still load."""

from __future__ import annotations

import io
import pickletools
from typing import Any

import pytest
import torch

from lightning_preempt.format import TensorRef
from lightning_preempt.format.pickles.unpickle import load_state_bytes
from lightning_preempt.format.skeleton import split_checkpoint


def _skeleton() -> dict[str, Any]:
    state = {f"layer{i}.weight": torch.zeros(2) for i in range(300)}
    _, skeleton = split_checkpoint({"state_dict": state, "optimizer_states": [], "global_step": 4})
    return skeleton


def _saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _opcodes(archive: bytes) -> list[str]:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return [op.name for op, _, _ in pickletools.genops(pkl)]


def test_placeholders_pickle_as_one_reduce_each_and_load_back() -> None:
    skeleton = _skeleton()
    data = _saved(skeleton)
    ops = _opcodes(data)
    assert ops.count("REDUCE") == 300 and "BUILD" not in ops and "NEWOBJ" not in ops
    loaded = load_state_bytes(data, path="test")
    assert loaded == skeleton
    assert loaded["state_dict"]["layer7.weight"] == TensorRef("state_dict/layer7.weight")


def test_skeletons_written_before_still_load(monkeypatch: pytest.MonkeyPatch) -> None:
    skeleton = _skeleton()
    monkeypatch.delattr(TensorRef, "__reduce__")  # the dataclass's own pickling, as before
    old = _saved(skeleton)
    monkeypatch.undo()
    assert "BUILD" in _opcodes(old)
    assert load_state_bytes(old, path="test") == skeleton
