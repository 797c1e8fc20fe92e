"""Small tensors outside the sharded keys (RNG states, ``ModelCheckpoint``'s scores) are
pickled inline in the skeleton (``lightning_preempt.format.tensor_from_bytes``), so the
skeleton never takes torch's per-object ``persistent_id`` path for them (issue 33); every
other tensor still does, and old state files load as before (test_old_checkpoints.py)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyModel, data
from torch.utils.data import DataLoader

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning
from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format import INLINE_TENSOR_MAX_BYTES, TensorRef, tensor_from_bytes
from lightning_preempt.format.pickles import unpickle
from lightning_preempt.format.pickles.check import check_state_pickle
from lightning_preempt.format.pickles.unpickle import load_state_bytes
from lightning_preempt.write.skeleton_bytes import skeleton_bytes


def _torch_save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _storage_records(data: bytes) -> list[str]:
    return [n for n in zipfile.ZipFile(io.BytesIO(data)).namelist() if "/data/" in n]


def _small_tensors() -> dict[str, torch.Tensor]:
    return {
        "rng": torch.get_rng_state(),
        "kth_value": torch.tensor(float("inf")),
        "score": torch.tensor(0.5, dtype=torch.float64),
        "bf16": torch.arange(5, dtype=torch.bfloat16),
        "mask": torch.tensor([[True, False], [False, True]]),
        "empty": torch.empty(0, 3),
        "ints": torch.arange(-3, 3, dtype=torch.int64).reshape(2, 3),
        "cplx": torch.tensor([1 + 2j], dtype=torch.complex64),
    }


def _skeleton(extra: dict[str, Any]) -> dict[str, Any]:
    refs = {f"layer.{i}.weight": TensorRef(f"state_dict/layer.{i}.weight") for i in range(200)}
    return {"global_step": 7, "state_dict": refs, "callbacks": {"cb": extra}, "hparams": {"lr": 0.1}}


def _off_fast_path(*_: Any) -> Any:
    raise unpickle.OffFastPath("forced: the weights-only path")


def test_small_tensors_are_inline_and_load_back_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    small = _small_tensors()
    data = skeleton_bytes(_skeleton(small))
    assert _storage_records(data) == []  # no storage went through persistent_id
    assert data != _torch_save(_skeleton(small))
    check_state_pickle(data, path="x")  # the no-torch check the CLI's verify runs accepts it
    fast = load_state_bytes(data, path="x")
    monkeypatch.setattr(unpickle, "fast_load_state", _off_fast_path)
    slow = load_state_bytes(data, path="x")
    with torch.serialization.safe_globals([TensorRef, tensor_from_bytes]):
        plain = torch.load(io.BytesIO(data), weights_only=True)
    for loaded in (fast, slow, plain):
        assert loaded["state_dict"]["layer.3.weight"] == TensorRef("state_dict/layer.3.weight")
        for key, want in small.items():
            got = loaded["callbacks"]["cb"][key]
            assert type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got, want), key
    got = fast["callbacks"]["cb"]["rng"]
    got.add_(1)  # a tensor of its own, writable (torch.set_rng_state takes it)
    assert not torch.equal(got, small["rng"])


def test_one_object_twice_stays_one_object() -> None:
    score = torch.tensor(0.25)
    data = skeleton_bytes(_skeleton({"kth_value": score, "best_k_models": {"a.ckpt": score}}))
    assert _storage_records(data) == []
    cb = load_state_bytes(data, path="x")["callbacks"]["cb"]
    assert cb["kth_value"] is cb["best_k_models"]["a.ckpt"]  # the pickle's memo, as torch.save keeps it


@pytest.mark.parametrize(
    "make",
    [
        lambda: {"t": torch.arange(6.0).reshape(2, 3).t()},  # not contiguous
        lambda: {"t": torch.arange(6.0)[2:]},  # a view into a larger storage
        lambda: (lambda a: {"a": a, "b": a.view(2, 3)})(torch.arange(6.0)),  # two tensors, one storage
        lambda: {"t": torch.ones(3, requires_grad=True)},
        lambda: {"t": torch.nn.Parameter(torch.ones(3))},
        lambda: {"t": torch.zeros(INLINE_TENSOR_MAX_BYTES // 4 + 1)},  # too large to inline
        lambda: {"t": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)},
        lambda: {"t": torch.arange(3).untyped_storage()},
    ],
    ids=["transposed", "offset-view", "shared-storage", "requires-grad", "parameter", "large", "quantized", "storage"],
)
def test_other_tensors_are_saved_exactly_as_torch_save_does(make: Any) -> None:
    extra = make()
    skeleton = _skeleton({"rng": torch.get_rng_state(), **extra})  # an inline-able one beside it
    data = skeleton_bytes(skeleton)
    assert data == _torch_save(skeleton)  # all of it through torch's persistent_id, as before


@pytest.mark.parametrize(
    "args",
    [
        ("qint8", (2,), "\x00\x00"),
        ("Tensor", (1,), "\x00"),
        (torch.float32, (1,), "\x00" * 4),
        ("float32", (-1,), ""),
        ("float32", [1], "\x00" * 4),
        ("float32", (True,), "\x00" * 4),
        ("float32", (2,), "\x00" * 4),  # 4 bytes for 2 floats
        ("uint8", (1,), "\u0100"),  # not latin-1 text
        ("uint8", (1,), b"\x00"),
        ("uint8", (INLINE_TENSOR_MAX_BYTES + 1,), "\x00" * (INLINE_TENSOR_MAX_BYTES + 1)),
    ],
)
def test_tensor_from_bytes_refuses_arguments_it_never_writes(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        tensor_from_bytes(*args)


def test_a_damaged_inline_tensor_is_a_corrupt_checkpoint_not_a_crash() -> None:
    data = skeleton_bytes(_skeleton({"t": torch.arange(4, dtype=torch.int32)}))
    bad = data.replace(b"int32", b"int64")  # same length, 16 bytes now too few for 4 int64
    assert bad != data
    with pytest.raises(CorruptCheckpointError, match=r"not a readable torch\.save file"):
        load_state_bytes(bad, path="x")


def test_a_real_fit_keeps_its_state_tensors_inline_and_resumes_them(tmp_path: Path) -> None:
    def fit(max_steps: int) -> tuple[L.Trainer, ModelCheckpoint]:
        checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "mc"), every_n_train_steps=10, save_top_k=1)
        trainer = L.Trainer(
            max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[PreemptionCallback(dirpath=str(tmp_path / "run"), every_n_train_steps=3, tuning=Tuning(lease=False)),
                       checkpoints],
            plugins=[ShardedAsyncCheckpointIO()],
        )  # fmt: skip
        torch.manual_seed(3)
        trainer.fit(TinyModel(width=4), DataLoader(data(n=64), batch_size=8, shuffle=True))
        return trainer, checkpoints

    fit(3)
    step = tmp_path / "run" / "step-0000000003"
    state = (step / "state-rank00000.pt").read_bytes()
    assert _storage_records(state) == [] and b"tensor_from_bytes" in state  # inline, not persistent_id
    saved = ShardedAsyncCheckpointIO().load_checkpoint(str(step))
    outside: list[torch.Tensor] = []

    def walk(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            outside.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk({k: v for k, v in saved.items() if k not in ("state_dict", "optimizer_states")})
    assert len(outside) >= 2  # RNG state(s), ModelCheckpoint's kth_value
    mc = next(v for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert torch.equal(mc["kth_value"], torch.tensor(float("inf")))
    trainer, checkpoints = fit(5)  # resumes step 3 with those tensors
    assert trainer.global_step == 5 and torch.equal(checkpoints.kth_value, torch.tensor(float("inf")))
