"""Tier 0 across nodes with real gloo ranks and the real saver, no Trainer
(engine/memory_tier.py, tiers/tier0_peer.py).

Two ranks play two nodes, each with its own tier-0 root (its "/dev/shm"). Each copy
commits through the saver, then the peer copy sends each rank's share to the other node;
a node whose root is wiped (a replacement node) gets the newest copy back from its peer,
bit for bit; a torn copy is never restored; with both roots gone nothing is.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from lightning_preempt.catalog.listing import complete_local_checkpoints
from lightning_preempt.collective.groups import new_gloo_group
from lightning_preempt.engine.memory_tier import MemoryTier
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver


def _state(step: int, rank: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)  # the same replicated state on every rank (DDP)
    return {"state_dict": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(300, generator=g)},
            "global_step": step, "rank_note": rank}  # fmt: skip


def _copy(tier: MemoryTier, saver: Saver, step: int, rank: int) -> str | None:
    """What Engine.save_memory does: agree on the path (or the skip), save, queue what follows."""
    path = tier.path(step, dist.group.WORLD)
    if path is not None:
        saver.save(_state(step, rank), SaveOrder(path))
        tier.after_copy(saver, path, "run-1", leader=rank == 0)
    return path


def _tree(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _worker(rank: int, world: int, work: str) -> None:
    root = os.path.join(work, f"node{rank}", "tier0")
    saver = Saver({})
    saver.enable_collective(new_gloo_group(timeout_s=60))
    peer_group = new_gloo_group(timeout_s=60)  # one for every set-up below (each would make its own)
    tier = MemoryTier(root, every=2, keep=2)
    assert tier.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: peer_group)
    out: dict[str, object] = {"nodes": tier.nodes, "replicating": tier.replicating}
    for step in (2, 4, 6):
        assert _copy(tier, saver, step, rank) is not None
        saver.wait()  # the copy, its peer copy and retention (else the next one is skipped)
    out["complete"] = sorted(c.step for c in complete_local_checkpoints(root))
    # A peer copy still running on one rank: the next due copy is skipped on both ranks.
    gate = threading.Event()
    if rank == 1:
        saver.submit(gate.wait)  # holds rank 1's job thread: its peer copy of step 8 waits behind it
    assert _copy(tier, saver, 8, rank) is not None
    out["skipped_10"] = _copy(tier, saver, 10, rank) is None
    gate.set()
    saver.wait()
    out["after_skip"] = sorted(c.step for c in complete_local_checkpoints(root))
    dist.barrier()
    Path(work, f"tree{rank}.json").write_text(json.dumps(sorted(_tree(root))))
    out["same_bytes"] = rank == 0 or _tree(root) == _tree(os.path.join(work, "node0", "tier0"))

    def restart(floor: int = -1) -> MemoryTier:
        again = MemoryTier(root, every=2, keep=2)
        usable = again.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: peer_group,
                             restore_floor=lambda: floor)  # fmt: skip
        assert usable
        return again

    # A replacement node 1: empty memory. Node 0 sends the newest copy back, bit for bit.
    before = _tree(root)
    dist.barrier()
    if rank == 1:
        shutil.rmtree(root)
    dist.barrier()
    out["older_than_disk"] = restart(floor=100).restored_step  # the disk is newer: not restored
    out["still_empty"] = not any(Path(root).glob("step-*"))
    again = restart()
    out["restored"] = again.restored_step
    out["complete_after_restore"] = sorted(c.step for c in complete_local_checkpoints(root))
    newest = "step-0000000008"
    out["restored_bit_identical"] = {k: v for k, v in _tree(root).items() if k.startswith(newest)} == {
        k: v for k, v in before.items() if k.startswith(newest)
    }
    out["again_same_nodes"] = restart().restored_step  # nothing missing: nothing sent
    # Torn: node 1 wiped again and node 0's copy of rank 1's shard of step 8 cut short:
    # step 8 is complete nowhere, so step 6 (whole on node 0) is restored instead.
    dist.barrier()
    if rank == 1:
        shutil.rmtree(root)
    else:
        shard = next(Path(root, newest).glob("__1_*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-7])
    dist.barrier()
    out["torn_restored"] = restart().restored_step
    dist.barrier()
    if rank == 0:  # rank 0's node replaced: node 1 sends it back
        shutil.rmtree(root)
    dist.barrier()
    out["node0_replaced"] = restart().restored_step
    out["node0_same_as_node1"] = rank == 1 or _tree(root) == _tree(os.path.join(work, "node1", "tier0"))
    dist.barrier()
    shutil.rmtree(root)  # both nodes lost: nothing to restore, the disk tiers decide
    dist.barrier()
    os.makedirs(root)
    out["both_lost"] = restart().restored_step
    saver.close()
    Path(work, f"out{rank}.json").write_text(json.dumps(out))


@pytest.mark.multiproc
def test_peer_copy_lands_and_a_wiped_node_is_restored_bit_for_bit(tmp_path: Path) -> None:
    run_ranks(_worker, 2, tmp_path, str(tmp_path))
    outs = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(2)]
    for out in outs:
        assert out["nodes"] == ["tier0-0", "tier0-1"] and out["replicating"]
        assert out["complete"] == [4, 6]  # each node holds the whole copy; retention kept 2
        assert out["skipped_10"]  # agreed: rank 1's peer copy was still queued
        assert out["after_skip"] == [6, 8]
        assert out["same_bytes"]  # node 1's tier 0 is node 0's, byte for byte
        assert out["restored"] == 8 and out["complete_after_restore"][-1] == 8
        assert out["restored_bit_identical"]
        assert out["again_same_nodes"] is None and out["older_than_disk"] is None
        assert out["still_empty"] or out is outs[0]
        assert out["torn_restored"] == 6
        assert out["node0_replaced"] == 6 and out["node0_same_as_node1"]
        assert out["both_lost"] is None
    trees = [json.loads((tmp_path / f"tree{r}.json").read_text()) for r in range(2)]
    assert trees[0] == trees[1] and any(n.startswith("step-0000000008/__1_") for n in trees[0])


def _uneven_worker(rank: int, world: int, work: str) -> None:
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("lightning_preempt").addHandler(Keep())
    root = os.path.join(work, "nodeA" if rank < 2 else "nodeB", "tier0")  # ranks 0, 1 share a node
    tier = MemoryTier(root, every=2, keep=2)
    on = tier.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: new_gloo_group(timeout_s=60))
    Path(work, f"uneven{rank}.json").write_text(json.dumps({"on": on, "nodes": tier.nodes, "log": seen}))


@pytest.mark.multiproc
def test_uneven_nodes_turn_tier0_off_with_a_hint(tmp_path: Path) -> None:
    """Two ranks on one node, one on the other: node B would hold two peers' shares, more
    than the bound, so tier 0 is off (the disk tiers go on) and rank 0 says why."""
    run_ranks(_uneven_worker, 3, tmp_path, str(tmp_path))
    outs = [json.loads((tmp_path / f"uneven{r}.json").read_text()) for r in range(3)]
    assert [o["on"] for o in outs] == [False, False, False]
    assert outs[0]["nodes"] == ["tier0-0", "tier0-0", "tier0-2"]
    [warning] = [m for m in outs[0]["log"] if "tier 0" in m]
    assert "as many ranks on every node; here [1, 2]" in warning and "HINT: " in warning
    assert "Run the same number of ranks per node" in warning


def _two_per_node_worker(rank: int, world: int, work: str) -> None:
    node = rank // 2
    root = os.path.join(work, f"node{node}", "tier0")
    saver = Saver({})
    saver.enable_collective(new_gloo_group(timeout_s=60))
    peer_group = new_gloo_group(timeout_s=60)
    tier = MemoryTier(root, every=2, keep=2)
    assert tier.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: peer_group)
    for step in (2, 4):
        assert _copy(tier, saver, step, rank) is not None
        saver.wait()
    dist.barrier()
    before = _tree(root)
    dist.barrier()
    if rank == 2:  # node 1 (ranks 2 and 3) replaced
        shutil.rmtree(root)
    dist.barrier()
    again = MemoryTier(root, every=2, keep=2)
    assert again.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: peer_group, restore_floor=lambda: -1)
    saver.close()
    dist.barrier()
    def newest(tree: dict[str, bytes]) -> dict[str, bytes]:
        return {k: v for k, v in tree.items() if k.startswith("step-0000000004/")}

    out = {"nodes": tier.nodes, "restored": again.restored_step, "same": newest(_tree(root)) == newest(before),
           "shards": sorted(n for n in _tree(root) if n.endswith(".distcp"))}  # fmt: skip
    Path(work, f"two{rank}.json").write_text(json.dumps(out))


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_ranks_per_node_replicate_and_restore(tmp_path: Path) -> None:
    """4 ranks on 2 nodes (rank i of node 0 sends to rank i of node 1): every node ends with
    every rank's shard, and a replaced node gets all of them back, spread over its 2 ranks."""
    run_ranks(_two_per_node_worker, 4, tmp_path, str(tmp_path))
    outs = [json.loads((tmp_path / f"two{r}.json").read_text()) for r in range(4)]
    for out in outs:
        assert out["nodes"] == ["tier0-0", "tier0-0", "tier0-2", "tier0-2"]
        assert out["restored"] == 4 and out["same"]
        assert [n for n in out["shards"] if n.startswith("step-0000000004/")] == [
            f"step-0000000004/__{r}_0.distcp" for r in range(4)
        ]
