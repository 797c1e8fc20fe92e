"""A checkpoint that fails its CRC32C on one rank only: every rank falls back together."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.multiproc


def _worker(rank: int, init_file: str, root: str) -> None:
    import torch.distributed as dist

    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    io = ShardedAsyncCheckpointIO()
    io.enable_collective_saves(new_gloo_group(timeout_s=60))
    # Rank 1 sees a damaged copy of step 2 (as with node-local copies), rank 0 an intact one.
    newest = os.path.join(root, "step-2-bad" if rank == 1 else "step-2")
    old = os.path.join(root, "step-1")
    io.alias("pointer", newest, fallback=lambda excluded: old if old not in excluded else None)
    out: dict[str, Any] = {"rank": rank}
    out["step"] = io.load_checkpoint("pointer")["global_step"]
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


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
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    ctx = mp.start_processes(
        _worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("ranks hung")
    steps = [json.loads((tmp_path / f"rank{r}.json").read_text())["step"] for r in range(2)]
    assert steps == [1, 1]  # rank 0's intact step 2 is not used alone


def _verify_worker(rank: int, init_file: str, root: str) -> None:
    import torch.distributed as dist

    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.errors import CorruptCheckpointError
    from lightning_preempt.read.load import verify_shared
    from lightning_preempt.read.verify import read_manifest
    from lightning_preempt.storage.store import Store

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
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
    dist.destroy_process_group()


def test_sharded_verification_splits_the_files_and_every_rank_learns_of_damage(tmp_path: Path) -> None:
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.arange(4096.0)}}, str(tmp_path / "good"))
    io.wait()
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    (shard,) = (tmp_path / "bad").glob("*.distcp")  # the largest file: verified by rank 0 only
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    ctx = mp.start_processes(
        _verify_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("ranks hung")
    outs = [json.loads((tmp_path / f"verify{r}.json").read_text()) for r in range(2)]
    assert [o["good"] for o in outs] == [None, None]
    assert all(o["bad"] and "CRC32C" in o["bad"] for o in outs), outs
