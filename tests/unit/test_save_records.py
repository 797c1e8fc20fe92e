"""Tensor records written from per-shape templates: the same bytes as ``torch.save``, far
fewer calls, and checkpoints that plain DCP and our loader read back exactly."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage.store import Store
from lightning_preempt.write import dcp_writer, records


def _torch_save(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    with dcp_writer._skip_zip_crc32():
        torch.save(tensor, buffer)
    return buffer.getvalue()


def _record(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    with dcp_writer._skip_zip_crc32():
        records.write_tensor_record(buffer, tensor)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(7, 5),
        torch.arange(300, dtype=torch.int64),
        torch.randn(3, 4, 5).to(torch.bfloat16),
        torch.tensor(2.5, dtype=torch.float64),
        torch.tensor([True, False, True]),
        torch.randn(2, 3).t().contiguous(),
    ],
    ids=["f32", "i64", "bf16", "scalar", "bool", "2d"],
)
def test_a_record_is_byte_for_byte_what_torch_save_writes(tensor: torch.Tensor) -> None:
    records.clear_templates()
    first = _record(tensor)
    again = _record(tensor + 1 if tensor.dtype != torch.bool else ~tensor)  # from the cached template
    assert first == _torch_save(tensor)
    assert again == _torch_save(tensor + 1 if tensor.dtype != torch.bool else ~tensor)
    loaded = torch.load(io.BytesIO(first), weights_only=True)
    assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)


@pytest.mark.parametrize(
    "tensor",
    [torch.randn(6, 4).t(), torch.randn(10)[2:5], torch.randn(3, requires_grad=True), torch.empty(0, 3)],
    ids=["transposed", "view", "grad", "empty"],
)
def test_tensors_a_template_cannot_hold_go_through_torch_save(tensor: torch.Tensor) -> None:
    got = _record(tensor)
    assert got == _torch_save(tensor)
    assert torch.equal(torch.load(io.BytesIO(got), weights_only=True), tensor.detach())


def test_with_the_zip_crc_on_no_template_is_used_and_bytes_stay_torch_saves() -> None:
    records.clear_templates()
    tensor = torch.randn(16)
    buffer = io.BytesIO()
    records.write_tensor_record(buffer, tensor)  # CRC-32 on: archives differ by data
    reference = io.BytesIO()
    torch.save(tensor, reference)
    assert buffer.getvalue() == reference.getvalue()
    assert all(parts is None for key, parts in records._templates.items() if key[0])


def _many(n: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(64,), (8, 16), (3, 5, 7)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64]
    state = {f"p{i}": torch.randn(shapes[i % 3], generator=gen).to(dtypes[i % 3]) for i in range(n)}
    state["odd"] = torch.arange(12.0).reshape(3, 4).t()  # a view: torch.save
    return {"state_dict": state, "optimizer_states": [], "global_step": 5, "epoch": 0}


def test_thousands_of_small_tensors_cost_few_torch_saves_and_few_writes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spy counts the real calls: one torch.save per shape and dtype (two to check each
    template), not one per tensor; storage sees a few large writes, not ~40 per tensor."""
    ckpt = _many(1500)
    records.clear_templates()
    saves: list[int] = []
    writes: list[int] = []
    real_save, real_write = torch.save, dcp_writer._HashingStream.write

    def counting_save(*args: Any, **kwargs: Any) -> None:
        saves.append(1)
        real_save(*args, **kwargs)

    def counting_write(self: Any, b: Any) -> int:
        writes.append(memoryview(b).nbytes)
        return real_write(self, b)

    monkeypatch.setattr(torch, "save", counting_save)
    monkeypatch.setattr(dcp_writer._HashingStream, "write", counting_write)
    saver = Saver({})
    url = str(tmp_path / "ckpt")
    saver.save(ckpt, SaveOrder(url), wait=True)
    saver.close()
    monkeypatch.undo()
    assert len(saves) <= 3 * 2 + 1 + 1 + 1  # templates (2 each), the view, skeleton, staging none
    assert len(writes) < 50, len(writes)
    # plain DCP reads every tensor back, as does our verified loader
    targets = {f"state_dict/{k}": torch.empty_like(v) for k, v in ckpt["state_dict"].items()}
    dcp.load(targets, checkpoint_id=url, no_dist=True)
    loaded = load_full_checkpoint(Store(url))
    for key, tensor in ckpt["state_dict"].items():
        assert torch.equal(targets[f"state_dict/{key}"], tensor), key
        got = loaded["state_dict"][key]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
