"""DDP de-duplication before staging, across 2 real ranks (gloo): each rank stages only
the share it writes, the checkpoint is complete, and a rank dying mid-save commits nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import run_ranks

pytestmark = pytest.mark.multiproc


def _state(step: int, extra_on_rank: int | None = None, rank: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)  # the same on every rank: replicated
    ckpt: dict[str, Any] = {
        "global_step": step,
        "state_dict": {f"layer{i}.weight": torch.randn(64 + 8 * i, 32, generator=gen) for i in range(6)},
        "optimizer_states": [
            {"state": {i: {"momentum_buffer": torch.randn(64 + 8 * i, 32, generator=gen)} for i in range(6)}}
        ],
        "rank_state": rank,  # per-rank, outside the sharded keys
    }
    if extra_on_rank == rank:
        ckpt["state_dict"]["only_here"] = torch.ones(3)
    return ckpt


def _one_tensor(step: int) -> dict[str, Any]:
    return {"global_step": step, "state_dict": {"w": torch.arange(10.0) + step}}


def _big_state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"global_step": step, "state_dict": {f"w{i}": torch.randn(1 << 18, generator=gen) for i in range(8)}}


def _worker(rank: int, world: int, root: str, scenario: str) -> None:
    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO(host_memory_budget=2 << 20 if scenario == "budget" else None)
    out: dict[str, Any] = {"rank": rank}
    if scenario == "alone_then_group":  # a save before the job's group exists, of the same state
        io.save_checkpoint(_one_tensor(1), os.path.join(root, f"alone-rank{rank}"))
        io.wait()
    io.enable_collective_saves(new_gloo_group(timeout_s=60))
    if scenario == "budget":  # each rank's 4 MiB share over its 2 MiB budget: half streamed
        ckpt = _big_state(3)
        io.save_checkpoint(ckpt, os.path.join(root, "step-3"))
        for t in ckpt["state_dict"].values():
            t.mul_(-1.0)  # the next step, as soon as this rank's save returned
        io.wait()
        plan = io.saver.budget.last_split
        out.update(peak=io.saver.stager.peak_bytes, streamed=plan.streamed_bytes, total=plan.total_bytes)
    elif scenario == "dedupe":
        io.prepare_staging(_state(1), background=True)
        io.save_checkpoint(_state(1, rank=rank), os.path.join(root, "step-1"))
        out["staged"] = io.staging_last_bytes
        out["allocated"] = io.staging_allocated_bytes
        io.wait()
    elif scenario == "different_keys":
        io.save_checkpoint(_state(1, extra_on_rank=1, rank=rank), os.path.join(root, "step-1"))
        out["staged"] = io.staging_last_bytes
        io.wait()
        allocated = io.staging_allocated_bytes
        # still different: every rank stages all from the start (no share staged and dropped first)
        io.save_checkpoint(_state(2, extra_on_rank=1, rank=rank), os.path.join(root, "step-2"))
        out.update(staged_again=io.staging_last_bytes, allocated_again=io.staging_allocated_bytes - allocated)
        io.wait()
        for step in (3, 4):  # the same again: all once more (as the last save found), then shares
            io.save_checkpoint(_state(step, rank=rank), os.path.join(root, f"step-{step}"))
            out[f"staged_same_{step}"] = io.staging_last_bytes
            io.wait()
    elif scenario == "one_tensor":  # rank 1 owns nothing: it writes only its skeleton
        io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.arange(10.0)}}, os.path.join(root, "step-4"))
        out["staged"] = io.staging_last_bytes
        io.wait()
    elif scenario == "replay":  # the same structure saved 3 times: plans, layouts and .metadata reused
        for step in (1, 2, 3):
            io.save_checkpoint(_state(step, rank=rank), os.path.join(root, f"step-{step}"))
            io.wait()
        cache = io.saver.plan_cache
        out.update(hits=dict(cache.hits), replayed=cache.records is not None, pickled=cache.metadata_pickles.hits,
                   results_unsent=cache.results_kept.hits)  # fmt: skip
        # the structure changes on every rank (a new tensor), then stays: planned afresh, then unsent again
        for step in (4, 5):
            ckpt = _state(step, rank=rank)
            ckpt["state_dict"]["new.bias"] = torch.full((7,), float(step))
            io.save_checkpoint(ckpt, os.path.join(root, f"step-{step}"))
            io.wait()
        out["hits_after_change"] = dict(cache.hits)
        # the coordinator loses its plans (as if it had failed alone): the save fails loudly on
        # both ranks, and the next one plans afresh everywhere and commits
        if rank == 0:
            cache.clear()
        try:
            io.save_checkpoint(_state(6, rank=rank), os.path.join(root, "step-6"))
            io.wait()
            out["out_of_step"] = None
        except Exception as err:
            out["out_of_step"] = f"{type(err).__name__}: {err}"
        io.save_checkpoint(_state(7, rank=rank), os.path.join(root, "step-7"))
        io.wait()
    elif scenario == "alone_then_group":  # the plans made alone are not offered to the group
        for step in (2, 3):  # rank 0 owns the one tensor: its share is what it saved alone
            io.save_checkpoint(_one_tensor(step), os.path.join(root, f"step-{step}"))
            io.wait()
        out["hits"] = dict(io.saver.plan_cache.hits)
    elif scenario == "rank_dies":
        io.save_checkpoint(_state(1, rank=rank), os.path.join(root, "step-1"))
        io.wait()
        io.save_checkpoint(_state(2, rank=rank), os.path.join(root, "step-2"))
        if rank == 1:
            os._exit(3)  # dies with its share staged, before (or while) writing it
        try:
            io.wait()
            out["error"] = None
        except Exception as err:
            out["error"] = f"{type(err).__name__}: {err}"
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # rank 1 may be gone: no collective teardown


def _run(tmp_path: Path, scenario: str) -> list[dict[str, Any]]:
    codes = [0, 3] if scenario == "rank_dies" else [0, 0]  # rank 1 dies on purpose there
    run_ranks(_worker, 2, tmp_path, str(tmp_path), scenario, timeout_s=150, exit_codes=codes)
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]


def _state_bytes(ckpt: dict[str, Any]) -> int:
    tensors = list(ckpt["state_dict"].values()) + [
        s["momentum_buffer"] for s in ckpt["optimizer_states"][0]["state"].values()
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def _assert_complete(url: str, step: int) -> None:
    from lightning_preempt.read.load import load_full_checkpoint
    from lightning_preempt.storage.store import Store

    loaded = load_full_checkpoint(Store(url))
    expected = _state(step)
    for key, t in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], t), key
    for i, s in expected["optimizer_states"][0]["state"].items():
        assert torch.equal(loaded["optimizer_states"][0]["state"][i]["momentum_buffer"], s["momentum_buffer"])
    assert loaded["global_step"] == step


def test_each_rank_stages_only_its_share(tmp_path: Path) -> None:
    outcomes = _run(tmp_path, "dedupe")
    total = _state_bytes(_state(1))
    for o in outcomes:
        assert 0 < o["staged"] <= 0.6 * total, (o, total)
        assert o["allocated"] == o["staged"]  # preallocated exactly the share, nothing more at save time
    assert sum(o["staged"] for o in outcomes) == total  # every tensor staged exactly once
    _assert_complete(str(tmp_path / "step-1"), 1)
    # Both ranks wrote a shard file; each rank's own skeleton is kept.
    names = os.listdir(tmp_path / "step-1")
    assert {"state-rank00000.pt", "state-rank00001.pt"} <= set(names)
    assert len([n for n in names if n.endswith(".distcp")]) == 2


def test_ranks_with_different_tensors_stage_everything(tmp_path: Path) -> None:
    """The ranks' fingerprints are gathered while each copies its share (issue 33): where they
    differ, every rank stages all before its save returns, and from the start while they keep
    differing; once they agree, shares again from the save after."""
    outcomes = _run(tmp_path, "different_keys")
    total = _state_bytes(_state(1))
    assert [o["staged"] for o in outcomes] == [total, total + 12]
    assert [o["staged_again"] for o in outcomes] == [total, total + 12]
    assert [o["allocated_again"] for o in outcomes] == [0, 0]
    assert [o["staged_same_3"] for o in outcomes] == [total, total]
    assert sum(o["staged_same_4"] for o in outcomes) == total and all(o["staged_same_4"] < total for o in outcomes)
    for step in (1, 2, 3, 4):
        _assert_complete(str(tmp_path / f"step-{step}"), step)


def test_a_rank_dying_mid_save_commits_nothing_and_the_previous_checkpoint_is_whole(tmp_path: Path) -> None:
    outcomes = _run(tmp_path, "rank_dies")
    assert [o["rank"] for o in outcomes] == [0]
    assert outcomes[0]["error"] and "HINT:" in outcomes[0]["error"], outcomes
    assert not (tmp_path / "step-2" / "manifest.json").exists()
    _assert_complete(str(tmp_path / "step-1"), 1)


def test_a_rank_that_owns_nothing_still_commits_with_the_others(tmp_path: Path) -> None:
    from lightning_preempt.read.load import load_full_checkpoint
    from lightning_preempt.storage.store import Store

    outcomes = _run(tmp_path, "one_tensor")
    assert sorted(o["staged"] for o in outcomes) == [0, 40]
    loaded = load_full_checkpoint(Store(str(tmp_path / "step-4")), rank=1)
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(10.0)) and loaded["global_step"] == 4


@pytest.mark.slow
def test_over_budget_shares_stream_on_every_rank_and_the_checkpoint_is_exact(tmp_path: Path) -> None:
    from lightning_preempt.read.load import load_full_checkpoint
    from lightning_preempt.storage.store import Store

    outcomes = _run(tmp_path, "budget")
    for o in outcomes:
        assert o["total"] == 4 << 20 and o["streamed"] > 0 and o["peak"] <= 2 << 20, o
    loaded = load_full_checkpoint(Store(str(tmp_path / "step-3")))
    expected = _big_state(3)["state_dict"]
    assert loaded["global_step"] == 3 and loaded["state_dict"].keys() == expected.keys()
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in expected.items())


def test_saves_of_one_structure_replay_on_every_rank_and_each_checkpoint_is_its_own(tmp_path: Path) -> None:
    """Issue 26: both ranks reuse their plans and shard layouts (the second rank's plan
    arrives unpickled from the coordinator: found equal, not identical), the coordinator its
    pickled .metadata entries; every checkpoint holds its own step's values."""
    outcomes = _run(tmp_path, "replay")
    for o in outcomes:
        # saves 2 and 3: no plan travelled (DCP's usable=False protocol), the coordinator
        # counted both; each rank replayed its layout
        assert o["hits"] == {"local": 2, "unsent": 2 if o["rank"] == 0 else 0} and o["replayed"], o
        # save 4 (a new tensor) planned afresh where the new tensor landed in a rank's share
        # (the other rank reused its plan: the coordinator merged it with the cached one);
        # save 5 travelled unsent again
        after = o["hits_after_change"]
        assert after["unsent"] == (3 if o["rank"] == 0 else 0), o
        assert after["local"] in (3, 4), o
        assert o["out_of_step"] is not None and "out of step" in o["out_of_step"], o
    assert sorted(o["hits_after_change"]["local"] for o in outcomes)[0] == 3  # some rank planned save 4 afresh
    assert outcomes[0]["pickled"] >= 2
    # issue 33: in saves 2 and 3 both ranks' write results reached the coordinator as a token
    assert outcomes[0]["results_unsent"] == 4 and outcomes[1]["results_unsent"] == 0
    for step in (1, 2, 3, 4, 5, 7):
        _assert_complete(str(tmp_path / f"step-{step}"), step)
    from lightning_preempt.read.load import load_full_checkpoint
    from lightning_preempt.storage.store import Store

    loaded = load_full_checkpoint(Store(str(tmp_path / "step-5")))
    assert torch.equal(loaded["state_dict"]["new.bias"], torch.full((7,), 5.0))
    assert not (tmp_path / "step-6" / "manifest.json").exists()  # the failed save committed nothing


def test_a_saver_used_alone_then_in_a_group_plans_afresh_for_the_group(tmp_path: Path) -> None:
    """A plan made alone (no group) never travels as unsent to a group: the first group save
    plans afresh on every rank and commits, the second reuses it unsent."""
    from lightning_preempt.read.load import load_full_checkpoint
    from lightning_preempt.storage.store import Store

    outcomes = _run(tmp_path, "alone_then_group")
    assert outcomes[0]["hits"] == {"local": 1, "unsent": 1}, outcomes  # save 3 only
    for name, step in [("step-2", 2), ("step-3", 3), ("alone-rank0", 1), ("alone-rank1", 1)]:
        loaded = load_full_checkpoint(Store(str(tmp_path / name)))
        assert loaded["global_step"] == step and torch.equal(loaded["state_dict"]["w"], torch.arange(10.0) + step)
