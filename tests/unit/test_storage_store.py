"""The storage seam: its primitives and what is derived from them, on local disk and
``memory://``, and the one durable local write (storage/local.py)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from lightning_preempt.errors import CheckpointExistsError, CorruptCheckpointError
from lightning_preempt.read.verify import check_regular
from lightning_preempt.storage import local
from lightning_preempt.storage.local import Owned
from lightning_preempt.storage.store import Entry, Store, files_below, kind_at


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    # a memory:// path of its own without "[...]": fsspec's recursive delete reads it as a glob
    return Store(str(tmp_path / "root") if request.param == "local" else f"memory://lp-store-{uuid.uuid4().hex}/root")


def test_entries_name_kind_and_size_and_what_derives_from_them(store: Store) -> None:
    assert store.entries() == [] and store.stat() is None
    store.makedirs("sub")
    store.commit_bytes("a.bin", b"12345")
    store.commit_bytes("sub/b.bin", b"xy")
    assert store.entries() == [Entry("a.bin", "file", 5), Entry("sub", "dir", None)]
    assert store.stat("a.bin") == Entry("a.bin", "file", 5) and store.stat("nope") is None
    assert kind_at(store) == "dir" and kind_at(store, "sub") == "dir" and kind_at(store, "a.bin") == "file"
    assert kind_at(store, "nope") is None
    assert store.stat("sub/b.bin") == Entry("b.bin", "file", 2)
    assert [(e.name, e.kind) for e in store.entries()] == [("a.bin", "file"), ("sub", "dir")]
    assert files_below(store) == ["a.bin", "sub/b.bin"]
    with store.open_read("sub/b.bin") as reader, store.open_write("c.bin") as writer:
        writer.write(reader.read())
    assert store.read_bytes("c.bin") == b"xy"
    store.rm_file("a.bin")
    store.rm_file("a.bin")  # already gone: fine
    store.rm_tree("sub", owned=Owned(store.path("sub")))  # (the ownership check is catalog/ownership.py's)
    assert [e.name for e in store.entries()] == ["c.bin"]


def test_create_only_commit_accepts_the_same_bytes_and_refuses_others(store: Store) -> None:
    store.makedirs()
    store.commit_bytes("manifest.json", b"first")
    store.commit_bytes("manifest.json", b"first")  # a retried PUT whose answer was lost
    with pytest.raises(CheckpointExistsError, match="refusing to overwrite") as caught:
        store.commit_bytes("manifest.json", b"second")
    assert "\nHINT: " in str(caught.value)
    assert store.read_bytes("manifest.json") == b"first"
    store.commit_bytes("manifest.json", b"second", exclusive=False)
    assert store.read_bytes("manifest.json") == b"second"
    assert [e.name for e in store.entries()] == ["manifest.json"]  # no temporary file left


def test_a_failed_streamed_write_leaves_nothing(store: Store) -> None:
    store.makedirs()
    with pytest.raises(RuntimeError), store.open_write("__0_0.distcp") as f:
        f.write(b"partial")
        raise RuntimeError("the writer died")
    assert store.entries() == []


def test_read_bytes_is_size_capped(store: Store) -> None:
    store.makedirs()
    store.commit_bytes("manifest.json", b"x" * 100)
    assert store.read_bytes("manifest.json", 100) == b"x" * 100
    with pytest.raises(CorruptCheckpointError, match="larger than the 99 bytes"):
        store.read_bytes("manifest.json", 99)


def test_local_reads_refuse_symlinks_and_fifos(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"not a checkpoint")
    os.symlink(tmp_path / "secret", tmp_path / "manifest.json")
    os.mkfifo(tmp_path / "state-rank00000.pt")
    store = Store(str(tmp_path))
    assert {e.name: e.kind for e in store.entries()} == {
        "manifest.json": "link",
        "secret": "file",
        "state-rank00000.pt": "other",
    }
    with pytest.raises(CorruptCheckpointError, match="a symbolic link"):
        store.read_bytes("manifest.json")
    with pytest.raises(CorruptCheckpointError, match="a FIFO"):  # and it does not block
        store.read_bytes("state-rank00000.pt")
    with pytest.raises(CorruptCheckpointError, match="a symbolic link"):
        check_regular(store, "manifest.json", 16)


def test_write_atomic_publishes_all_or_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "last.ckpt")
    local.write_atomic(path, b"old")

    def refuse(tmp: str) -> None:
        assert Path(tmp).read_bytes() == b"new"  # durable before it is checked
        raise ValueError("not publishable")

    with pytest.raises(ValueError, match="not publishable"):
        local.write_atomic(path, b"new", check=refuse)
    assert Path(path).read_bytes() == b"old" and os.listdir(tmp_path) == ["last.ckpt"]
    with pytest.raises(FileExistsError):
        local.write_atomic(path, b"new", exclusive=True)
    assert Path(path).read_bytes() == b"old" and os.listdir(tmp_path) == ["last.ckpt"]
    local.write_atomic(path, lambda f: f.write(b"streamed"), tmp_name=".last.ckpt.lp-new-0123456789ab")
    assert Path(path).read_bytes() == b"streamed" and os.listdir(tmp_path) == ["last.ckpt"]


def test_replace_entry_swaps_a_file_for_a_directory(tmp_path: Path) -> None:
    path, new, aside = tmp_path / "last.ckpt", tmp_path / ".new", tmp_path / ".old"
    path.write_bytes(b"a plain file")
    new.mkdir()
    (new / "manifest.json").write_bytes(b"{}")
    local.replace_entry(str(path), str(new), str(aside), first="manifest.json")
    assert (path / "manifest.json").read_bytes() == b"{}"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_object_store_kind_is_one_property(tmp_path: Path, memory_url: str) -> None:
    assert not Store(str(tmp_path)).is_object_store
    assert not Store(memory_url).is_object_store  # a file and a directory cannot share a path there


def test_an_entry_deleted_while_listed_is_left_out_not_the_whole_listing(tmp_path: Path) -> None:
    """Another rank deletes its probe file while this rank lists the root (DDP set-up): the
    listing must still show everything else. The entry is taken from scandir, then deleted,
    then looked at, as the race orders it."""

    (tmp_path / "keep").write_bytes(b"1")
    (tmp_path / "gone").write_bytes(b"22")
    entries = {e.name: e for e in os.scandir(tmp_path)}
    os.unlink(tmp_path / "gone")
    assert local._kind_and_size(entries["gone"]) is None
    assert local._kind_and_size(entries["keep"]) == ("file", 1)
    assert local.scan(str(tmp_path)) == [("keep", "file", 1)]
