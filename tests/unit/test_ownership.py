"""Remove-only-if-ours: a checkpoint directory is deleted only when everything in it is a file
this package writes (names from format/names.py); anything else makes the deletion refuse,
with a HINT, before a single byte is deleted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_preempt.catalog.ownership import foreign_entries, remove_if_ours
from lightning_preempt.errors import CheckpointExistsError
from lightning_preempt.format.names import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    MARKER_NAME,
    new_generation,
    state_file,
)
from lightning_preempt.storage.local import Owned
from lightning_preempt.storage.store import Store

OURS = {
    MANIFEST_NAME: b'{"format": "lightning_preempt.checkpoint"}',
    DCP_METADATA_NAME: b"metadata",
    "__0_0.distcp": b"shard of rank 0",
    "__1_0.distcp": b"shard of rank 1",
    state_file(0): b"state 0",
    state_file(1): b"state 1",
    MARKER_NAME: b"",
    ".manifest.json.0123abcd.tmp": b"a killed commit's manifest",
    ".lightning_preempt.writer": b"the in-place writer's claim",
    "..lightning_preempt.writer.0123abcd.tmp": b"a killed claim's temporary file",
    ".metadata.tmp": b"DCP's own temporary metadata",
}


def _fill(root: Path) -> str:
    """A checkpoint directory of ours (files and a generation directory) at ``root``."""
    generation = new_generation()
    for base in (root, root / generation):
        base.mkdir(parents=True, exist_ok=True)
        for name, data in OURS.items():
            (base / name).write_bytes(data)
    return generation


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry below ``root``: bytes for files, the kind for anything else (never followed)."""
    out: dict[str, object] = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(base, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = f"link -> {os.readlink(path)}"
            elif path.is_fifo():
                out[rel] = "fifo"
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = path.read_bytes()
    return out


def test_a_directory_holding_only_our_files_is_deleted(tmp_path: Path) -> None:
    root = tmp_path / "step-0000000001"
    generation = _fill(root)
    assert _snapshot(root)[f"{generation}/__1_0.distcp"] == b"shard of rank 1"
    assert foreign_entries(Store(str(root))) == []
    remove_if_ours(Store(str(root)), why="test")
    assert not root.exists()
    assert sorted(os.listdir(tmp_path)) == []


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _symlink_to_user_data(path: Path) -> None:
    target = path.parent.parent / "dataset.bin"
    target.write_bytes(b"user data")
    path.symlink_to(target)


FOREIGN = {
    "a user file": (lambda root, gen: (root / "notes.txt").write_bytes(b"mine"), "notes.txt"),
    "a symlink": (lambda root, gen: _symlink_to_user_data(root / "__2_0.distcp"), "__2_0.distcp (link)"),
    "a FIFO": (lambda root, gen: _fifo(root / state_file(7)), "state-rank00007.pt (other)"),
    "an unknown subdirectory": (lambda root, gen: (root / "data").mkdir(), "data (dir)"),
    "a foreign file in a generation": (
        lambda root, gen: (root / gen / "README.md").write_bytes(b"keep me"),
        "/README.md",
    ),
}


@pytest.mark.parametrize("case", list(FOREIGN))
def test_anything_not_ours_refuses_the_deletion_and_nothing_is_deleted(tmp_path: Path, case: str) -> None:
    root = tmp_path / "run" / "step-0000000001"
    generation = _fill(root)
    plant, named = FOREIGN[case]
    plant(root, generation)
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointExistsError) as caught:
        remove_if_ours(Store(str(root)), why="test")
    message = str(caught.value)
    assert "refusing to delete" in message and named in message
    assert "\nHINT: " in message and "docs/security.md" in message
    assert _snapshot(tmp_path) == before  # every byte, link and FIFO still there


def test_a_symlinked_checkpoint_directory_is_never_deleted_through(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere" / "step-0000000001"
    _fill(real)
    link = tmp_path / "run" / "step-0000000001"
    link.parent.mkdir()
    link.symlink_to(real, target_is_directory=True)
    before = _snapshot(tmp_path)
    with pytest.raises(CheckpointExistsError, match="a symlink"):
        remove_if_ours(Store(str(link)), why="test")
    assert _snapshot(tmp_path) == before
    assert (real / MANIFEST_NAME).read_bytes() == OURS[MANIFEST_NAME]


def test_object_like_stores_keep_a_directory_with_foreign_objects(memory_url: str) -> None:
    store = Store(f"{memory_url}/step-0000000001")
    for name, data in OURS.items():
        store.commit_bytes(name, data, exclusive=False)
    store.commit_bytes("dataset/part-0", b"user data", exclusive=False)
    with pytest.raises(CheckpointExistsError, match=r"dataset \(dir\)"):
        remove_if_ours(store, why="test")
    assert store.read_bytes("dataset/part-0") == b"user data"
    assert store.read_bytes(MANIFEST_NAME) == OURS[MANIFEST_NAME]
    store.rm_tree("dataset", owned=Owned(store.path("dataset")))  # the user deletes their own data
    remove_if_ours(store, why="test")
    assert store.stat() is None and store.entries() == []
