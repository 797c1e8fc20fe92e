"""A checkpoint that fails its CRC32C on one rank only: every rank falls back together."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import flip_byte
from ranks import run_ranks

pytestmark = pytest.mark.multiproc


def _worker(rank: int, world: int, root: str) -> None:
    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO()
    io.enable_collective_saves(new_gloo_group(timeout_s=60))
    # Rank 1 sees a damaged copy of step 2 (as with node-local copies), rank 0 an intact one.
    newest = os.path.join(root, "step-2-bad" if rank == 1 else "step-2")
    old = os.path.join(root, "step-1")
    io.alias("pointer", newest, fallback=lambda excluded: old if old not in excluded else None)
    out: dict[str, Any] = {"rank": rank}
    out["step"] = io.load_checkpoint("pointer")["global_step"]
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def test_one_rank_finding_damage_makes_every_rank_fall_back(tmp_path: Path) -> None:
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint(
            {"global_step": step, "state_dict": {"w": torch.full((4096,), float(step))}}, str(tmp_path / f"step-{step}")
        )
        io.wait()
    shutil.copytree(tmp_path / "step-2", tmp_path / "step-2-bad")
    (shard,) = (tmp_path / "step-2-bad").glob("*.distcp")
    flip_byte(shard, mask=0x10)
    run_ranks(_worker, 2, tmp_path, str(tmp_path))
    steps = [json.loads((tmp_path / f"rank{r}.json").read_text())["step"] for r in range(2)]
    assert steps == [1, 1]  # rank 0's intact step 2 is not used alone


def _verify_worker(rank: int, world: int, root: str) -> None:
    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.errors import CorruptCheckpointError
    from lightning_preempt.read.load import verify_shared
    from lightning_preempt.read.verify import read_manifest
    from lightning_preempt.storage.store import Store

    group = new_gloo_group(timeout_s=60)
    out: dict[str, Any] = {"rank": rank}
    for name in ("good", "bad"):
        store = Store(os.path.join(root, name))
        try:
            verify_shared(store, read_manifest(store), group)
            out[name] = None
        except CorruptCheckpointError as err:
            out[name] = str(err).splitlines()[0]
    Path(root, f"verify{rank}.json").write_text(json.dumps(out))


def test_sharded_verification_splits_the_files_and_every_rank_learns_of_damage(tmp_path: Path) -> None:
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.arange(4096.0)}}, str(tmp_path / "good"))
    io.wait()
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    (shard,) = (tmp_path / "bad").glob("*.distcp")  # the largest file: verified by rank 1 only
    flip_byte(shard, mask=0x10)
    run_ranks(_verify_worker, 2, tmp_path, str(tmp_path))
    outs = [json.loads((tmp_path / f"verify{r}.json").read_text()) for r in range(2)]
    assert [o["good"] for o in outs] == [None, None]
    assert all(o["bad"] and "CRC32C" in o["bad"] for o in outs), outs


def _unreadable_worker(rank: int, world: int, root: str) -> None:
    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.read.load import verify_shared
    from lightning_preempt.read.verify import read_manifest
    from lightning_preempt.storage.store import Store

    def denied(self: Store, rel: str) -> Any:
        raise PermissionError(13, "Permission denied", rel)

    group = new_gloo_group(timeout_s=20)
    store = Store(os.path.join(root, "good"))
    manifest = read_manifest(store)
    if rank == 1:  # the files of rank 1's share cannot be read there (permissions, an I/O error)
        Store.open_read = denied  # type: ignore[method-assign]
    try:
        verify_shared(store, manifest, group)
        outcome = "verified"
    except Exception as err:
        outcome = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    Path(root, f"unreadable{rank}.json").write_text(json.dumps(outcome))


def test_an_error_reading_on_one_rank_is_raised_on_every_rank(tmp_path: Path) -> None:
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.arange(4096.0)}}, str(tmp_path / "good"))
    io.wait()
    run_ranks(_unreadable_worker, 2, tmp_path, str(tmp_path), timeout_s=60)
    outs = [json.loads((tmp_path / f"unreadable{r}.json").read_text()) for r in range(2)]
    assert all("PermissionError" in o for o in outs), outs  # rank 0 (its files fine) raises rank 1's error
