"""The tier-0 seal (read/seal.py): a copy CRC32C-verified on this node since it last changed
loads without hashing it again, bit for bit; any change after the seal is refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import save_and_wait

from lightning_preempt.engine.memory_tier import seal_copy
from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format.names import SEAL_NAME, is_our_file
from lightning_preempt.read import load as load_mod
from lightning_preempt.read import seal as seal_mod
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.read.seal import on_tmpfs, seal, sealed
from lightning_preempt.read.verify import read_manifest
from lightning_preempt.storage.store import Store

pytestmark = pytest.mark.skipif(not on_tmpfs("/dev/shm"), reason="/dev/shm is not a tmpfs here")


def _checkpoint() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {
        "global_step": 9,
        "state_dict": {"w": torch.randn(256, 129, generator=gen), "b": torch.randn(7, generator=gen).half()},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(256, 129, generator=gen)}}, "param_groups": []}],
    }


def _spy_verify(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The ``verify`` each tensor read was asked for."""
    seen: list[bool] = []
    real = load_mod.read_tensors

    def spy(*args: Any, verify: bool = True, **kwargs: Any) -> Any:
        seen.append(verify)
        return real(*args, verify=verify, **kwargs)

    monkeypatch.setattr(load_mod, "read_tensors", spy)
    return seen


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key, t in a["state_dict"].items():
        got = b["state_dict"][key]
        assert got.dtype == t.dtype and torch.equal(got, t), key
    assert torch.equal(b["optimizer_states"][0]["state"][0]["exp_avg"], a["optimizer_states"][0]["state"][0]["exp_avg"])


def _biggest(path: str) -> str:
    return max((os.path.join(path, n) for n in os.listdir(path)), key=os.path.getsize)


def test_a_sealed_copy_loads_bit_identical_without_hashing(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = _checkpoint()
    path = save_and_wait(shm / "step-9", ckpt)
    seen = _spy_verify(monkeypatch)
    _same(ckpt, load_full_checkpoint(Store(path)))  # not sealed yet: every byte hashed
    assert seen == [True]
    assert seal_copy(path) and (shm / "step-9" / SEAL_NAME).exists()
    assert sealed(path, read_manifest(Store(path)))
    # Ours, so retention removes the copy with its seal (catalog/ownership.py).
    assert all(is_our_file(n) for n in os.listdir(path)) and is_our_file(SEAL_NAME + ".0123abcd.tmp")
    _same(ckpt, load_full_checkpoint(Store(path)))
    assert seen == [True, False]


@pytest.mark.parametrize("damage", ["overwrite", "truncate", "replace"])
def test_a_change_after_the_seal_is_refused(shm: Path, damage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_and_wait(shm / "step-9", _checkpoint())
    assert seal_copy(path)
    victim = _biggest(path)
    size = os.path.getsize(victim)
    if damage == "overwrite":  # same size, same inode: only the ctime tells
        with open(victim, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\x00\xff" * 64)
        st = os.stat(victim)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # mtime set back: ctime moves still
    elif damage == "truncate":
        os.truncate(victim, size - 100)
    else:  # a torn file renamed over it, same size
        tmp = victim + ".new"
        with open(victim, "rb") as f, open(tmp, "wb") as g:
            data = bytearray(f.read())
            data[size // 2] ^= 0xFF
            g.write(data)
        os.replace(tmp, victim)
    assert not sealed(path, read_manifest(Store(path)))
    seen = _spy_verify(monkeypatch)
    with pytest.raises(CorruptCheckpointError):
        load_full_checkpoint(Store(path))
    assert seen in ([], [True])  # a truncation fails the size check before any tensor read


def test_a_copy_torn_before_the_seal_is_not_sealed(shm: Path) -> None:
    path = save_and_wait(shm / "step-9", _checkpoint())
    victim = _biggest(path)
    with open(victim, "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x02\x03")
    assert not seal_copy(path) and not (shm / "step-9" / SEAL_NAME).exists()
    with pytest.raises(CorruptCheckpointError):
        load_full_checkpoint(Store(path))
    assert not seal_copy(str(shm / "step-10"))  # no manifest (a copy killed mid-write): nothing


def test_a_seal_from_another_boot_or_off_tmpfs_counts_for_nothing(
    shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_and_wait(shm / "step-9", _checkpoint())
    assert seal_copy(path)
    manifest = read_manifest(Store(path))
    monkeypatch.setattr(seal_mod, "boot_id", lambda: "another-boot")
    assert not sealed(path, manifest)
    monkeypatch.undo()
    # The same files and seal on a disk directory: a disk is always verified in full.
    disk = tmp_path / "step-9"
    shutil.copytree(path, disk)
    assert not on_tmpfs(str(disk)) and not seal(str(disk), manifest) and not sealed(str(disk), manifest)
    # A seal that does not parse, or names other files, is no seal.
    (shm / "step-9" / SEAL_NAME).write_text("{torn")
    assert not sealed(path, manifest)
    (shm / "step-9" / SEAL_NAME).write_text(json.dumps({"version": 1, "boot_id": seal_mod.boot_id(), "files": {}}))
    assert not sealed(path, manifest)
