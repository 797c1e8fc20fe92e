"""The peer replica (lightning_preempt/replica.py) with real gloo ranks, no Trainer.

Each rank plays one rank on a "node" (``GROUP_RANK`` as torchrun sets it) with the node's own
local tier; after :func:`replicate` every file of the checkpoint must be on two nodes, with
its CRC32C, so losing any one node's disk leaves a complete copy among the others.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch.distributed as dist
from ranks import run_ranks

from lightning_preempt.catalog.listing import complete_local_checkpoints
from lightning_preempt.format.manifest import FileEntry, Manifest
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.tiers.peer import complete_from_peers, placement, plan_union, replicate


def test_placement_puts_each_copy_on_the_next_node() -> None:
    p = placement(["a", "a", "b", "b", "c", "c"])
    assert p.buddy == [2, 3, 4, 5, 0, 1]
    assert all(p.node_of[r] != p.node_of[b] for r, b in enumerate(p.buddy) if b is not None)
    assert placement(["a", "b", "b"]).buddy == [1, 0, 0]  # uneven nodes: still another node
    assert placement(["a", "a"]).buddy == [None, None]  # one node: nowhere else to go


def _files_of(rank: int) -> dict[str, bytes]:
    g = random.Random(rank)
    out = {f"__{rank}_0.distcp": g.randbytes(300_000 + rank), f"state-rank{rank:05d}.pt": g.randbytes(1000)}
    if rank == 0:
        out[".metadata"] = g.randbytes(777)
    return out


def _write_share(local: str, rank: int, world: int) -> None:
    """This rank's files of checkpoint step 7 in ``local``; rank 0 also writes the manifest
    of every rank's files (the commit)."""
    os.makedirs(local, exist_ok=True)
    for name, data in _files_of(rank).items():
        Path(local, name).write_bytes(data)
    if rank == 0:
        entries = {}
        for r in range(world):
            for name, data in _files_of(r).items():
                crc = Crc32c()
                crc.update(data)
                entries[name] = FileEntry(size=len(data), crc32c=crc.hexdigest())
        Path(local, MANIFEST_NAME).write_bytes(Manifest(step=7, epoch=0, world_size=world, files=entries).to_json())


def _worker(rank: int, world: int, root: str, ranks_per_node: int) -> None:
    node = rank // ranks_per_node
    os.environ.update({"GROUP_RANK": str(node), "TORCHELASTIC_RUN_ID": "t"})
    local = os.path.join(root, f"node{node}", "step-0000000007")
    _write_share(local, rank, world)
    dist.barrier()
    report = replicate(local, dist.group.WORLD)
    Path(root, f"report{rank}.json").write_text(
        json.dumps({"sent": report.bytes_sent, "received": report.bytes_received, "holders": report.holders})
    )


@pytest.mark.multiproc
@pytest.mark.parametrize(("world", "ranks_per_node"), [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_every_file_survives_the_loss_of_any_one_node(tmp_path: Path, world: int, ranks_per_node: int) -> None:
    run_ranks(_worker, world, tmp_path, str(tmp_path), ranks_per_node)
    nodes = world // ranks_per_node
    reports = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(world)]
    share = {r: sum(len(d) for d in _files_of(r).values()) for r in range(world)}
    for r, rep in enumerate(reports):
        assert rep["sent"] == share[r]  # each rank sends exactly its own share: the floor
    assert sum(rep["received"] for rep in reports) == sum(share.values())
    all_files = {n: d for r in range(world) for n, d in _files_of(r).items()}
    assert all(len(v) == 2 for v in reports[0]["holders"].values())
    assert set(reports[0]["holders"]) == set(all_files)
    for lost in range(nodes):  # any one node's disk gone: the others hold every file, bit for bit
        union: dict[str, bytes] = {}
        for node in range(nodes):
            if node != lost:
                d = tmp_path / f"node{node}" / "step-0000000007"
                union.update({p.name: p.read_bytes() for p in d.iterdir() if p.name != MANIFEST_NAME})
        assert union == all_files
    if nodes == 2:  # either survivor alone holds a complete, committed checkpoint
        for node in range(2):
            assert [c.step for c in complete_local_checkpoints(str(tmp_path / f"node{node}"))] == [7]


def test_plan_union_takes_the_newest_checkpoint_the_ranks_hold_together() -> None:
    crc = Crc32c()
    files = {"__0_0.distcp": FileEntry(10, crc.hexdigest()), "__1_0.distcp": FileEntry(20, crc.hexdigest())}
    raw = Manifest(step=9, epoch=0, world_size=2, files=files).to_json()
    newer = {"step-0000000011": {"manifest": None, "files": {"__0_0.distcp": 10}}}  # never committed
    ranks = [
        {**newer, "step-0000000009": {"manifest": raw, "files": {"__0_0.distcp": 10}}},
        {"step-0000000009": {"manifest": None, "files": {"__0_0.distcp": 10, "__1_0.distcp": 20}}},
    ]
    assert plan_union(ranks) == ("step-0000000009", raw, {"__0_0.distcp": 0, "__1_0.distcp": 1})  # type: ignore[arg-type]
    ranks[1]["step-0000000009"]["files"] = {"__1_0.distcp": 19}  # a short copy does not count
    assert plan_union(ranks) is None  # type: ignore[arg-type]


def _union_worker(rank: int, world: int, root: str) -> None:
    os.environ.update({"GROUP_RANK": str(rank), "TORCHELASTIC_RUN_ID": "t"})
    local_root = os.path.join(root, f"node{rank}")
    local = os.path.join(local_root, "step-0000000007")
    _write_share(local, rank, world)
    dist.barrier()
    replicate(local, dist.group.WORLD)
    dist.barrier()
    if rank == world - 1:  # this node is reclaimed: its disk is gone
        import shutil

        shutil.rmtree(local_root)
    dist.barrier()
    step = complete_from_peers(local_root, os.path.join(root, "bucket"), {}, dist.group.WORLD)
    Path(root, f"union{rank}.json").write_text(json.dumps({"step": step}))


@pytest.mark.multiproc
@pytest.mark.slow
def test_three_nodes_one_lost_the_survivors_complete_the_checkpoint_in_the_bucket(tmp_path: Path) -> None:
    """No survivor holds every file after a node of three is lost; together they do, and
    upload the checkpoint (each file once) so the bucket holds it complete and committed."""
    from lightning_preempt.read.verify import verify_checkpoint
    from lightning_preempt.storage.store import Store

    world = 3
    run_ranks(_union_worker, world, tmp_path, str(tmp_path))
    assert [json.loads((tmp_path / f"union{r}.json").read_text())["step"] for r in range(world)] == [7, 7, 7]
    bucket = tmp_path / "bucket" / "step-0000000007"
    for r in range(world):
        for name, data in _files_of(r).items():
            assert (bucket / name).read_bytes() == data
    verify_checkpoint(Store(str(bucket)))  # committed, every CRC32C as in the manifest


# ---- the local tier is untrusted input (issue 20, finding 4) ----------------------------------
def _attack_worker(rank: int, world: int, root: str, attack: str) -> None:
    """Rank 0's local tier is tampered with after the commit; every rank records what
    :func:`replicate` did (its error's class and text, or ``ok``)."""
    import datetime

    from lightning_preempt.errors import CheckpointError

    os.environ.update({"GROUP_RANK": str(rank), "TORCHELASTIC_RUN_ID": "t"})
    local = os.path.join(root, f"node{rank}", "step-0000000007")
    _write_share(local, rank, world)
    if rank == 0:
        shard = os.path.join(local, "__0_0.distcp")
        if attack == "symlink":  # to a root-only file holding the very bytes: only the kind gives it away
            secret = os.path.join(root, "secret")
            Path(secret).write_bytes(Path(shard).read_bytes())
            os.chmod(secret, 0o600)
            os.remove(shard)
            os.symlink(secret, shard)
        elif attack == "fifo":  # opening it for reading would block until a writer comes
            os.remove(shard)
            os.mkfifo(shard)
        elif attack == "manifest-dev-zero":  # reading it whole never ends
            os.remove(os.path.join(local, MANIFEST_NAME))
            os.symlink("/dev/zero", os.path.join(local, MANIFEST_NAME))
    dist.barrier()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    try:
        replicate(local, group)
        outcome = {"ok": True}
    except CheckpointError as err:
        outcome = {"error": type(err).__name__, "message": str(err)}
    Path(root, f"outcome{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("attack", "said"),
    [("symlink", "a symbolic link"), ("fifo", "a FIFO"), ("manifest-dev-zero", "a symbolic link")],
)
def test_a_tampered_local_tier_is_refused_on_every_rank_and_nothing_reaches_the_peer(
    tmp_path: Path, attack: str, said: str
) -> None:
    """A shard swapped for a symlink (to a root-only file) or a FIFO, or a manifest linked to
    /dev/zero: every rank raises the same error naming the file (no hang: the ranks end
    within run_ranks' deadline), and the peer node holds only its own files, no manifest."""
    run_ranks(_attack_worker, 2, tmp_path, str(tmp_path), attack, timeout_s=90)
    outcomes = [json.loads((tmp_path / f"outcome{r}.json").read_text()) for r in range(2)]
    for outcome in outcomes:
        assert "error" in outcome, outcome
        assert said in outcome["message"] and "HINT:" in outcome["message"]
    if attack != "manifest-dev-zero":
        assert outcomes[0]["error"] == outcomes[1]["error"] == "ReplicaError"
        assert "__0_0.distcp" in outcomes[1]["message"]
    peer = tmp_path / "node1" / "step-0000000007"
    assert sorted(p.name for p in peer.iterdir()) == sorted(_files_of(1))  # not sent, nothing committed


def _no_pickle_worker(rank: int, world: int, root: str) -> None:
    """replicate then complete_from_peers with every object collective of torch.distributed
    (the ones that pickle) made to fail: the replica's path must not use any."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pickled object crossed the replica's collectives")

    for name in ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"):
        setattr(dist, name, refuse)
    os.environ.update({"GROUP_RANK": str(rank), "TORCHELASTIC_RUN_ID": "t"})
    local_root = os.path.join(root, f"node{rank}")
    _write_share(os.path.join(local_root, "step-0000000007"), rank, world)
    dist.barrier()
    report = replicate(os.path.join(local_root, "step-0000000007"), dist.group.WORLD)
    dist.barrier()
    ckpt = os.path.join(local_root, "step-0000000007")
    if rank == 0:  # its copy of rank 1's shard becomes a FIFO: held by nobody, never opened
        os.remove(os.path.join(ckpt, "__1_0.distcp"))
        os.mkfifo(os.path.join(ckpt, "__1_0.distcp"))
    else:  # its manifest becomes endless: not read whole, not trusted
        os.remove(os.path.join(ckpt, MANIFEST_NAME))
        os.symlink("/dev/zero", os.path.join(ckpt, MANIFEST_NAME))
    dist.barrier()
    step = complete_from_peers(local_root, os.path.join(root, "bucket"), {}, dist.group.WORLD)
    Path(root, f"nopickle{rank}.json").write_text(json.dumps({"received": report.bytes_received, "step": step}))


@pytest.mark.multiproc
def test_no_pickle_crosses_the_replica_path(tmp_path: Path) -> None:
    """The manifest and every value the ranks exchange travel as bytes (JSON), so no
    unpickler sees what came from the local tier; the replica and the upload still work,
    past a FIFO in one tier (the file is taken from the other) and a manifest linked to
    /dev/zero in the other (rank 0's is used)."""
    from lightning_preempt.read.verify import verify_checkpoint
    from lightning_preempt.storage.store import Store

    run_ranks(_no_pickle_worker, 2, tmp_path, str(tmp_path), timeout_s=90)
    results = [json.loads((tmp_path / f"nopickle{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in results] == [7, 7]
    assert results[0]["received"] == sum(len(d) for d in _files_of(1).values())
    bucket = tmp_path / "bucket" / "step-0000000007"
    for r in range(2):
        for name, data in _files_of(r).items():
            assert (bucket / name).read_bytes() == data
    verify_checkpoint(Store(str(bucket)))
