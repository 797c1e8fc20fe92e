"""The one-pass load: tensors are read once, verified on the way, and equal what was saved."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.read import archive, crc_reader
from lightning_preempt.read import tensors as fastload
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.storage.store import Store


def _checkpoint() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 33, generator=gen)
    return {
        "global_step": 7,
        "epoch": 1,
        "state_dict": {
            "w": weight,
            "wt": weight.t(),  # non-contiguous view of another tensor
            "half": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "ints": torch.arange(11, dtype=torch.int8),
        },
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.ones(9)}}, "param_groups": []}],
        "loops": {"step": 7},
    }


def _save(url: str, ckpt: dict[str, Any]) -> None:
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(ckpt, url)
    io.wait()


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key, tensor in a["state_dict"].items():
        got = b["state_dict"][key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got, tensor), key
    state = b["optimizer_states"][0]["state"][0]
    assert torch.equal(state["exp_avg"], torch.ones(9)) and float(state["step"]) == 7.0
    assert b["loops"] == {"step": 7} and b["global_step"] == 7


@pytest.mark.parametrize("verify", [True, False])
def test_one_pass_load_equals_what_was_saved(tmp_url: str, verify: bool) -> None:
    ckpt = _checkpoint()
    _save(tmp_url, ckpt)
    loaded = load_full_checkpoint(Store(tmp_url), verify=verify)
    _assert_same(ckpt, loaded)


def test_one_pass_load_from_memory_store(memory_url: str) -> None:
    ckpt = _checkpoint()
    _save(memory_url, ckpt)
    _assert_same(ckpt, load_full_checkpoint(Store(memory_url)))


def test_each_tensor_owns_exactly_its_bytes(tmp_url: str) -> None:
    ckpt = _checkpoint()
    _save(tmp_url, ckpt)
    loaded = load_full_checkpoint(Store(tmp_url))
    # Read straight into tensors of exactly their size: a kept tensor (optimizer state
    # often is the very tensor loaded) holds nothing else alive, and saves like any other.
    for key, t in loaded["state_dict"].items():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
    buf = io.BytesIO()
    torch.save(loaded["state_dict"], buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=True)
    assert all(torch.equal(again[k], v) for k, v in ckpt["state_dict"].items())


def _shard(url: str) -> str:
    (name,) = [n for n in os.listdir(url) if n.endswith(".distcp")]
    return os.path.join(url, name)


def test_flipped_byte_in_tensor_data_raises_corrupt(tmp_url: str) -> None:
    _save(tmp_url, _checkpoint())
    path = _shard(tmp_url)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32C") as info:
        load_full_checkpoint(Store(tmp_url))
    assert "HINT:" in str(info.value)
    # Without verification the damage goes unnoticed (which is why verify is the default).
    load_full_checkpoint(Store(tmp_url), verify=False)


@pytest.mark.parametrize("change", ["truncate", "append"])
def test_wrong_size_raises_corrupt_even_without_crc(tmp_url: str, change: str) -> None:
    _save(tmp_url, _checkpoint())
    path = _shard(tmp_url)
    size = os.path.getsize(path)
    if change == "truncate":
        os.truncate(path, size - 10)
    else:
        with open(path, "ab") as f:
            f.write(b"x")
    for verify in (True, False):
        with pytest.raises(CorruptCheckpointError, match="bytes, the manifest says"):
            load_full_checkpoint(Store(tmp_url), verify=verify)


def test_damaged_skeleton_raises_before_unpickling(tmp_url: str) -> None:
    _save(tmp_url, _checkpoint())
    path = os.path.join(tmp_url, "state-rank00000.pt")
    data = bytearray(Path(path).read_bytes())
    data[-30] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"state-rank00000\.pt"):
        load_full_checkpoint(Store(tmp_url))


def test_missing_shard_raises_corrupt(tmp_url: str) -> None:
    _save(tmp_url, _checkpoint())
    os.remove(_shard(tmp_url))
    with pytest.raises(CorruptCheckpointError, match="missing"):
        load_full_checkpoint(Store(tmp_url))


def test_chunks_of_a_sharded_tensor_are_assembled() -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    items, chunks = [], []
    for off in (0, 2, 4):
        items.append(fastload.TensorItem("t", "f", off, 1, torch.float32, (off, 0), (2, 4), (6, 4)))
        chunks.append(full[off : off + 2].clone())
    out = fastload.assemble(items, chunks)
    assert torch.equal(out["t"], full)


def test_small_chunks_pipeline_the_crc(tmp_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Many chunks per file: the CRC thread and the reads interleave; the result is the same.
    monkeypatch.setattr(crc_reader, "CHUNK_BYTES", 1 << 20)  # read_into reads it
    big = {"global_step": 1, "state_dict": {"a": torch.randn(3 << 20), "b": torch.randn(1000)}, "optimizer_states": []}
    _save(tmp_url, big)
    loaded = load_full_checkpoint(Store(tmp_url))
    assert torch.equal(loaded["state_dict"]["a"], big["state_dict"]["a"])
    assert torch.equal(loaded["state_dict"]["b"], big["state_dict"]["b"])


# ---- choosing cheaply, verifying during the load -------------------------------------


def _two_checkpoints(root: Path) -> tuple[str, str]:
    old, new = str(root / "step-0000000001"), str(root / "step-0000000002")
    for url, step in ((old, 1), (new, 2)):
        ckpt = _checkpoint()
        ckpt["global_step"] = step
        _save(url, ckpt)
    return old, new


def test_sizes_check_reads_no_data_but_catches_truncation(tmp_path: Path) -> None:
    from lightning_preempt.catalog.newest import newest_valid

    old, new = _two_checkpoints(tmp_path)
    path = _shard(new)
    with open(path, "r+b") as f:  # a flipped byte: sizes pass, the load's CRC catches it
        f.seek(100)
        f.write(b"\xff\xfe")
    chosen = newest_valid(str(tmp_path), verify="sizes")
    assert chosen is not None and chosen.path == new
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        load_full_checkpoint(Store(new))
    # The fall-back: choose again without the one that failed while loading.
    skipped: list[str] = []
    chosen = newest_valid(str(tmp_path), verify="sizes", exclude={new}, on_skip=lambda i, why: skipped.append(why))
    assert chosen is not None and chosen.path == old and skipped == ["failed its check while loading"]
    assert load_full_checkpoint(Store(chosen.path))["global_step"] == 1
    os.truncate(path, 10)  # a truncated file is caught by the cheap check already
    chosen = newest_valid(str(tmp_path), verify="sizes")
    assert chosen is not None and chosen.path == old


def test_sizes_check_on_memory_store(memory_url: str) -> None:
    from lightning_preempt.read.verify import check_sizes

    _save(memory_url, _checkpoint())
    manifest = check_sizes(Store(memory_url))
    assert manifest.step == 7
    Store(memory_url).rm_file(".metadata")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        check_sizes(Store(memory_url))


def test_archive_of_a_view_falls_back_to_torch_load() -> None:
    # torch.save of a view writes its whole storage: the data record is larger than the
    # chunk, the descriptor says so, and the reader lets torch parse that archive.
    big = torch.arange(100, dtype=torch.float32)
    for tensor in (big[10:20], torch.arange(5000, dtype=torch.float32)[:2000]):
        buf = io.BytesIO()
        torch.save(tensor, buf)
        data = buf.getvalue()
        item = fastload.TensorItem("t", "f", 0, len(data), torch.float32, (0,), (tensor.numel(),), (tensor.numel(),))
        got, n = archive.read_archive(io.BytesIO(data), item, crc_reader.Cursor(0))
        assert n == len(data) and got is not None and torch.equal(got, tensor)


def _flip(url: str) -> None:
    path = _shard(url)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def test_directory_load_falls_back_when_the_newest_fails_its_crc(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, new = _two_checkpoints(tmp_path)
    _flip(new)  # sizes still match: only the load's CRC catches it
    io_ = ShardedAsyncCheckpointIO()
    loaded = io_.load_checkpoint(str(tmp_path))
    assert loaded["global_step"] == 1
    assert any("failed its check while loading" in r.getMessage() for r in caplog.records)


def test_alias_with_fallback_and_without(tmp_path: Path) -> None:
    old, new = _two_checkpoints(tmp_path)
    _flip(new)
    io_ = ShardedAsyncCheckpointIO()
    io_.alias("pointer", new, fallback=lambda excluded: old if new in excluded else None)
    assert io_.load_checkpoint("pointer")["global_step"] == 1
    assert io_.loaded_from == old
    io_.alias("plain", new)  # no fallback: the error reaches the caller
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        io_.load_checkpoint("plain")
    _flip(old)
    with pytest.raises(CorruptCheckpointError, match="no older checkpoint verifies"):
        io_.load_checkpoint(str(tmp_path))


def test_a_large_file_read_in_two_ranges_verifies_in_file_order(tmp_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastload, "SPLIT_BYTES", 1 << 20)  # split even this small file
    monkeypatch.setattr(fastload, "SPLIT_MIN_RECORD_BYTES", 0)  # of small records
    monkeypatch.setattr(crc_reader, "CHUNK_BYTES", 1 << 18)
    ckpt = {
        "global_step": 1,
        "state_dict": {f"t{i}": torch.randn(50_000 + i) for i in range(8)},
        "optimizer_states": [],
    }
    _save(tmp_url, ckpt)
    assert fastload._ranges(sorted(fastload.tensor_items(_metadata(tmp_url)) or [], key=lambda i: i.offset), 2)[
        1
    ]  # two non-empty runs
    loaded = load_full_checkpoint(Store(tmp_url))
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in ckpt["state_dict"].items())
    _flip(tmp_url)  # damage in the second half: found by the second range's reads
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        load_full_checkpoint(Store(tmp_url))


def _metadata(url: str) -> Any:
    from lightning_preempt.format.pickles.unpickle import unpickle_dcp_metadata

    return unpickle_dcp_metadata(Path(url, ".metadata").read_bytes(), path=url)


@pytest.mark.parametrize(("n1", "n2"), [(0, 5), (5, 0), (1, 1), (1000, 12345), (3 << 20, (1 << 20) + 7)])
def test_crc_of_two_ranges_combines_to_the_crc_of_the_whole(n1: int, n2: int) -> None:
    from lightning_preempt.storage.checksum import Crc32c

    a, b = os.urandom(n1), os.urandom(n2)
    first, second, whole = Crc32c(), Crc32c(), Crc32c()
    first.update(a)
    second.update(b)
    whole.update(a + b)
    first.extend(second)
    assert (first.hexdigest(), first.nbytes) == (whole.hexdigest(), whole.nbytes)


@pytest.mark.parametrize("where", [40, 700])
def test_damage_in_an_archive_header_is_a_corrupt_checkpoint_not_a_parse_error(tmp_url: str, where: int) -> None:
    # Flipped bytes in a record's zip header make the archive unreadable as ours: the load
    # still reports CorruptCheckpointError (from the CRC), so auto-resume can fall back.
    _save(tmp_url, {"global_step": 1, "state_dict": {"w": torch.randn(4096)}, "optimizer_states": []})
    path = _shard(tmp_url)
    data = bytearray(Path(path).read_bytes())
    for i in range(where, where + 8):
        data[i] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        load_full_checkpoint(Store(tmp_url))


def _vm_flags(addr: int) -> list[str]:
    """The ``VmFlags`` of the mapping holding ``addr`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages: Linux only")
@pytest.mark.parametrize("host_takes_back", [False, True])
def test_large_tensors_ask_for_huge_pages_unless_the_host_takes_free_memory_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host_takes_back: bool
) -> None:
    """A load's large tensors ask for transparent huge pages (MADV_HUGEPAGE: the read faults
    2 MiB pages in, not 4 KiB ones; the kernel shows it as the mapping's ``hg`` flag), except
    where a virtio balloon reports free pages to the host: a fresh huge page is then faulted
    in on the host too (docs/resume-speed.md)."""
    balloon = tmp_path / "virtio3"
    balloon.mkdir()
    (balloon / "device").write_text("0x0005\n")
    (balloon / "features").write_text(("01100" + ("1" if host_takes_back else "0")).ljust(64, "0") + "\n")
    assert fastload.host_takes_back_free_memory(str(tmp_path)) is host_takes_back
    monkeypatch.setattr(fastload, "_advise_huge", not fastload.host_takes_back_free_memory(str(tmp_path)))
    advice: list[int] = []
    real = fastload._madvise
    assert real is not None

    def spy(addr: Any, length: Any, how: int) -> int:
        advice.append(how)
        return int(real(addr, length, how))

    monkeypatch.setattr(fastload, "_madvise", spy)

    t = fastload.new_tensor((8 << 20) // 4, torch.float32)
    assert t.shape == ((8 << 20) // 4,) and t.dtype == torch.float32
    assert advice == ([] if host_takes_back else [14])  # MADV_HUGEPAGE
    if not host_takes_back:  # (a mapping advised before may hold the tensor: only "advised" is certain)
        assert "hg" in _vm_flags(t.data_ptr() + (4 << 20))


def test_only_a_balloon_reporting_free_pages_counts_as_taking_memory_back(tmp_path: Path) -> None:
    """Other virtio devices, a balloon without free page reporting (feature bit 5), unreadable
    entries and a machine without virtio leave huge pages on."""
    assert not fastload.host_takes_back_free_memory(str(tmp_path / "absent"))
    for name, device, features in (("virtio0", "0x0002", "0" * 5 + "1"), ("virtio1", "0x0005", "1" * 5 + "0")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "device").write_text(device + "\n")
        (tmp_path / name / "features").write_text(features.ljust(64, "0") + "\n")
    (tmp_path / "virtio2").mkdir()  # no device file
    assert not fastload.host_takes_back_free_memory(str(tmp_path))
