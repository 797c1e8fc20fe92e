"""Loading thousands of small tensors: few large reads, every byte verified before any
tensor is returned, and tensors that own their memory."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format.pickles.unpickle import unpickle_dcp_metadata
from lightning_preempt.read import tensors as fastload
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage.store import Store

N = 1200


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    dtypes = [torch.float32, torch.bfloat16, torch.int32, torch.float64]
    sd = {f"m{i}": (torch.randn(5 + i % 7, 3, generator=gen) * 100).to(dtypes[i % 4]) for i in range(N)}
    return {"state_dict": sd, "optimizer_states": [], "global_step": 9, "epoch": 0}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    url = str(tmp_path_factory.mktemp("batched") / "ckpt")
    state = _state()
    saver = Saver({})
    saver.save(state, SaveOrder(url), wait=True)
    saver.close()
    return url, state


class _CountingFile:
    """A spy around the real file ``Store.open_read`` returns: counts reads from storage."""

    def __init__(self, inner: Any, calls: list[int]) -> None:
        self._inner = inner
        self._calls = calls

    def readinto(self, b: Any) -> int:
        self._calls.append(1)
        return self._inner.readinto(b)  # type: ignore[no-any-return]

    def read(self, n: int = -1) -> bytes:
        self._calls.append(1)
        return self._inner.read(n)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()


def test_small_tensors_load_with_few_reads_and_equal_values(
    saved: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, state = saved
    calls: list[int] = []
    real_open = Store.open_read

    def open_read(self: Store, rel: str) -> Any:
        f = real_open(self, rel)
        return _CountingFile(f, calls) if rel.endswith(".distcp") else f

    monkeypatch.setattr(Store, "open_read", open_read)
    loaded = load_full_checkpoint(Store(url))
    # reads from storage, not per record: 1 MiB each (measured: 1201 before, 3 now)
    assert len(calls) < N // 10, len(calls)
    for key, tensor in state["state_dict"].items():
        got = loaded["state_dict"][key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and got.stride() == tensor.stride(), key
        assert torch.equal(got, tensor), key


def test_loaded_tensors_are_independent(saved: tuple[str, dict[str, Any]]) -> None:
    """Each tensor owns exactly its bytes: writing one changes no other, and saving one
    saves only it (optimizer state often stays the very tensor that was loaded)."""
    url, _ = saved
    loaded = load_full_checkpoint(Store(url))["state_dict"]
    tensors = list(loaded.values())
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    for t in tensors[:50]:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    before = loaded["m1"].clone()
    loaded["m0"].fill_(7)
    assert torch.equal(loaded["m1"], before)
    buffer = io.BytesIO()
    torch.save(loaded["m5"], buffer)
    assert buffer.tell() < 4096 + loaded["m5"].numel() * loaded["m5"].element_size()


def _items(url: str) -> list[Any]:
    metadata = unpickle_dcp_metadata(Path(url, ".metadata").read_bytes(), path=url)
    return sorted(fastload.tensor_items(metadata) or [], key=lambda i: i.offset)


@pytest.mark.parametrize("where", ["record head", "tensor data", "record tail"])
def test_damage_inside_a_batched_read_is_found_before_any_tensor_is_returned(
    saved: tuple[str, dict[str, Any]], tmp_path: Path, where: str
) -> None:
    url, _ = saved
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(url):
        (copy / name).write_bytes(Path(url, name).read_bytes())
    item = _items(url)[N // 2]  # in the middle of a 1 MiB read, not at its edge
    offset = {
        "record head": item.offset + 40,
        "tensor data": item.offset + item.length // 2,
        "record tail": item.offset + item.length - 30,
    }[where]
    shard = copy / item.file
    with open(shard, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match=r"CRC32C|cannot be read"):
        load_full_checkpoint(Store(str(copy)))
