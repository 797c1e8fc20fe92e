"""DCP save plans reused while the state's structure is unchanged, made afresh when it changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from ckpts import assert_loads_both_ways

from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver


def _ckpt(step: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    state = {key: torch.randn(shape, generator=gen) for key, shape in shapes.items()}
    return {"state_dict": state, "optimizer_states": [], "global_step": step, "epoch": 0}



def test_plans_are_reused_until_the_structure_changes(tmp_path: Path) -> None:
    saver = Saver({})
    shapes = {f"w{i}": (4, 3) for i in range(50)}
    saves = [
        (1, shapes),
        (2, shapes),  # same structure: both plans reused
        (3, {**shapes, "w7": (5, 3)}),  # a shape changed: the stager's new buffer misses
        (4, {**shapes, "w7": (5, 3), "extra": (2,)}),  # a tensor more: misses
        (5, {**shapes, "w7": (5, 3), "extra": (2,)}),  # reused again
    ]
    hits = []
    try:
        for step, step_shapes in saves:
            ckpt = _ckpt(step, step_shapes)
            url = str(tmp_path / f"step{step}")
            saver.save(ckpt, SaveOrder(url), wait=True)
            hits.append(dict(saver.plan_cache.hits))
            assert_loads_both_ways(url, ckpt)  # the values and shapes of *this* save, by our loader and by DCP's
    finally:
        saver.close()
    assert [h["local"] for h in hits] == [0, 1, 1, 1, 2]
    assert [h["global"] for h in hits] == [0, 1, 1, 1, 2]


def test_a_copied_saver_starts_without_plans(tmp_path: Path) -> None:
    import copy

    saver = Saver({})
    saver.save(_ckpt(1, {"a": (3,)}), SaveOrder(str(tmp_path / "a")), wait=True)
    saver.close()
    twin = copy.deepcopy(saver)
    assert twin.plan_cache.local_plan is None and twin.plan_cache.hits == {"local": 0, "global": 0, "unsent": 0}
