"""One structure key per save (format/structure.py): every stage keeps what it derived from the
structure for that key, so a change between two saves reaches them all; while it holds, DCP's
plan caching (write/planning.py) reuses the plans."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import assert_loads_both_ways
from torch.distributed.checkpoint import default_planner

from lightning_preempt.format.dcp_compat import cached_plan
from lightning_preempt.format.shares import ShareMemo, own_share
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver


def _ckpt(step: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    state = {key: torch.randn(shape, generator=gen).to(dtype) for key, (shape, dtype) in shapes.items()}
    return {"state_dict": state, "optimizer_states": [], "global_step": step, "epoch": 0}


def test_a_structure_change_between_two_saves_reaches_every_stage(tmp_path: Path) -> None:
    base = {f"w{i}": ((4, 3), torch.float32) for i in range(50)}
    saves = [
        ("first", base),
        ("new key", {**base, "extra": ((2,), torch.float32)}),
        ("changed shape", {**base, "extra": ((2,), torch.float32), "w7": ((5, 3), torch.float32)}),
        ("changed dtype", {**base, "extra": ((2,), torch.float32), "w7": ((5, 3), torch.float64)}),
    ]
    saver, memo = Saver({}), ShareMemo()
    keys = []
    try:
        for step, (what, shapes) in enumerate(saves, 1):
            ckpt = _ckpt(step, shapes)
            url = str(tmp_path / f"step{step}")
            local_hits = saver.plan_cache.hits["local"]
            saver.save(ckpt, SaveOrder(url), wait=True)
            key = saver._structures._last
            assert key is not None and key not in keys, what  # a new key for every change
            keys.append(key)
            # every stage now holds what it derived for this key: the stager's routing, DCP's
            # local plan (made afresh, not reused), the shard files' layout of that plan
            assert saver.stager._plan is not None and saver.stager._plan.key is key, what
            assert saver.plan_cache.structure is key and saver.plan_cache.hits["local"] == local_hits, what
            assert saver.plan_cache.records is not None, what
            assert [item.index.fqn for item in saver.plan_cache.records.items] == list(key.keys), what
            assert_loads_both_ways(url, ckpt)  # the values, shapes and dtypes of *this* save
            # the DDP share (every rank's fingerprint and choice) follows the key too
            flat = {f"state_dict/{k}": v for k, v in ckpt["state_dict"].items()}
            for rank in range(2):
                assert list(memo.share(flat, rank, 2, key)[1]) == list(own_share(flat, rank, 2)), what
        saver.save(_ckpt(9, saves[-1][1]), SaveOrder(str(tmp_path / "again")), wait=True)  # unchanged: reused
        assert saver._structures._last is keys[-1] and saver.plan_cache.hits["local"] == 1
    finally:
        saver.close()
    assert_loads_both_ways(str(tmp_path / "again"), _ckpt(9, saves[-1][1]))


def test_an_unchanged_structure_reuses_dcps_cached_plans_of_its_own_saver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = {"local": 0, "global": 0}
    real_local = default_planner.create_default_local_save_plan
    real_global = default_planner.DefaultSavePlanner._create_global_plan

    def local(*args: Any, **kwargs: Any) -> Any:
        made["local"] += 1
        return real_local(*args, **kwargs)

    def global_(*args: Any, **kwargs: Any) -> Any:
        made["global"] += 1
        return real_global(*args, **kwargs)

    monkeypatch.setattr(default_planner, "create_default_local_save_plan", local)
    monkeypatch.setattr(default_planner.DefaultSavePlanner, "_create_global_plan", global_)
    shapes = {f"w{i}": ((4, 3), torch.float32) for i in range(20)}
    other_shapes = {"v": ((7,), torch.float16)}
    saver, other = Saver({}), Saver({})  # two savers in one process: each its own plans in DCP's cache
    try:
        for step in (1, 2, 3):
            saver.save(_ckpt(step, shapes), SaveOrder(str(tmp_path / f"s{step}")), wait=True)
            other.save(_ckpt(step, other_shapes), SaveOrder(str(tmp_path / f"o{step}")), wait=True)
        assert made == {"local": 2, "global": 2}  # once per saver, at its first save
        assert saver.plan_cache.hits == other.plan_cache.hits == {"local": 2, "unsent": 2}
        key = saver.plan_cache.key
        assert cached_plan(key, "save_plan") is not None and key != other.plan_cache.key
    finally:
        saver.close()
        other.close()
    for step in (1, 2, 3):
        assert_loads_both_ways(str(tmp_path / f"s{step}"), _ckpt(step, shapes))
        assert_loads_both_ways(str(tmp_path / f"o{step}"), _ckpt(step, other_shapes))
    del saver
    gc.collect()
    assert cached_plan(key, "save_plan") is None  # a dropped saver's plans leave DCP's cache


def test_a_copied_saver_starts_without_plans(tmp_path: Path) -> None:
    import copy

    saver = Saver({})
    saver.save(_ckpt(1, {"a": ((3,), torch.float32)}), SaveOrder(str(tmp_path / "a")), wait=True)
    saver.close()
    twin = copy.deepcopy(saver)
    assert twin.plan_cache.structure is None and twin.plan_cache.key != saver.plan_cache.key
    assert cached_plan(twin.plan_cache.key, "save_plan") is None
