"""Two saves in flight across 2 real ranks (gloo): the next save stages while the previous
one commits, every checkpoint holds its own step's values, manifests are committed in step
order, and a failed save is raised once, by the same save, on every rank."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import run_ranks

pytestmark = pytest.mark.multiproc

STEPS = 8
#: the longest a rank holds a commit for the other thread's signal; a hold ended by it (not by
#: the signal) is reported and fails the test, so a wrong implementation fails instead of hanging
HOLD_S = 30.0


def _values(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)  # the same on every rank: replicated, as under DDP
    return {f"layer{i}.weight": torch.randn(48 + 8 * i, 16, generator=gen) for i in range(6)}


def _checkpoint(tensors: dict[str, torch.Tensor], step: int, rank: int) -> dict[str, Any]:
    return {"global_step": step, "epoch": 0, "state_dict": tensors, "rank_state": rank}


def _saver(rank: int) -> Any:
    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.save.saver import Saver

    saver = Saver({})
    saver.enable_collective(new_gloo_group(timeout_s=60))
    saver.use_stage_group(new_gloo_group(timeout_s=60))
    return saver


def _record_commits(root: str, order: list[int]) -> None:
    """Rank 0 commits every manifest: note the steps in the order they are committed."""
    from lightning_preempt.format.names import MANIFEST_NAME
    from lightning_preempt.storage.store import Store

    real = Store.commit_bytes

    def commit(self: Store, rel: str, data: bytes, **kwargs: bool) -> None:
        real(self, rel, data, **kwargs)
        if rel == MANIFEST_NAME and self.url.startswith(root):
            order.append(json.loads(data)["step"])

    Store.commit_bytes = commit  # type: ignore[method-assign]


def _every_step(rank: int, root: str) -> dict[str, Any]:
    """Every-step saves of tensors changed in place after each save (the optimizer step);
    rank 0 holds step 1's manifest until step 2's save has returned on its training thread."""
    from lightning_preempt.format.names import MANIFEST_NAME
    from lightning_preempt.save.order import SaveOrder
    from lightning_preempt.storage.store import Store

    saver = _saver(rank)
    order: list[int] = []
    _record_commits(root, order)
    next_returned, held = threading.Event(), {"by_signal": None}
    real = Store.commit_bytes

    def hold(self: Store, rel: str, data: bytes, **kwargs: bool) -> None:
        if rel == MANIFEST_NAME and self.url.endswith("step-1"):
            held["by_signal"] = next_returned.wait(HOLD_S)
        real(self, rel, data, **kwargs)

    if rank == 0:
        Store.commit_bytes = hold  # type: ignore[method-assign]
    tensors = _values(1)
    for step in range(1, STEPS + 1):
        for key, value in _values(step).items():
            tensors[key].copy_(value)  # in place: the buffers the saver staged from last time
        saver.save(_checkpoint(tensors, step, rank), SaveOrder(os.path.join(root, f"step-{step}")))
        if step == 2:
            next_returned.set()
    saver.wait()
    return {"order": order, "held_by_signal": held["by_signal"], "history": [r.step for r in saver.history]}


def _second_fails(rank: int, root: str) -> dict[str, Any]:
    """Step 2 fails on rank 1 (its state file cannot be written), after its tensors were
    written. When step 3 is saved, step 2's failure has ended on rank 0 and not yet on rank 1
    (rank 1's job is held after the failure until its step-3 save returned): a rank that
    raised it there would leave the other in the share gather."""
    from lightning_preempt.format.names import state_file
    from lightning_preempt.save.order import SaveOrder
    from lightning_preempt.storage.store import Store

    saver = _saver(rank)
    order: list[int] = []
    _record_commits(root, order)
    step3_returned, held = threading.Event(), {"by_signal": None}
    if rank == 1:
        real_open = Store.open_write

        def open_write(self: Store, rel: str) -> Any:
            if rel == state_file(1) and self.url.endswith("step-2"):
                raise OSError(28, "No space left on device (injected)")
            return real_open(self, rel)

        Store.open_write = open_write  # type: ignore[method-assign]
        clear = saver.plan_cache.clear

        def held_clear() -> None:  # runs on the job thread once the failure is agreed
            if held["by_signal"] is None:
                held["by_signal"] = step3_returned.wait(HOLD_S)
            clear()

        saver.plan_cache.clear = held_clear
    raised: list[tuple[int, str]] = []
    tensors = _values(1)
    for step in range(1, 6):
        for key, value in _values(step).items():
            tensors[key].copy_(value)
        if step == 3 and rank == 0:
            deadline = time.monotonic() + 60  # (a bound against a hang, not a timed assertion)
            while not saver.pending_failed() and time.monotonic() < deadline:
                time.sleep(0.01)
        try:
            saver.save(_checkpoint(tensors, step, rank), SaveOrder(os.path.join(root, f"step-{step}")))
        except Exception as err:
            raised.append((step, f"{type(err).__name__}: {err}"))
        if step == 3:
            step3_returned.set()
    try:
        saver.wait()
    except Exception as err:
        raised.append((0, f"{type(err).__name__}: {err}"))
    return {"order": order, "raised": raised, "held_by_signal": held["by_signal"]}


def _worker(rank: int, world: int, root: str, scenario: str) -> None:
    out = {"rank": rank, **(_every_step if scenario == "every_step" else _second_fails)(rank, root)}
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    os._exit(0)  # every save waited for; tearing the gloo groups down waits out their timeout


def _run(tmp_path: Path, scenario: str) -> list[dict[str, Any]]:
    run_ranks(_worker, 2, tmp_path, str(tmp_path), scenario, timeout_s=150)
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]


def _assert_holds(url: str, step: int) -> None:
    from lightning_preempt.read.load import load_full_checkpoint
    from lightning_preempt.storage.store import Store

    for rank in (0, 1):
        loaded = load_full_checkpoint(Store(url), rank=rank)
        assert loaded["global_step"] == step and loaded["rank_state"] == rank
        expected = _values(step)
        assert loaded["state_dict"].keys() == expected.keys()
        for key, value in expected.items():
            got = loaded["state_dict"][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (url, key)  # bit-exact


def test_every_step_saves_at_two_ranks_stage_while_the_previous_commits(tmp_path: Path) -> None:
    outcomes = _run(tmp_path, "every_step")
    # rank 0's save of step 2 returned while step 1's manifest was still held (the staging
    # buffers reused while a commit runs): a save waiting for the previous commit never would
    assert outcomes[0]["held_by_signal"] is True, outcomes
    assert outcomes[0]["order"] == list(range(1, STEPS + 1))  # committed in step order
    for o in outcomes:
        assert o["history"] == list(range(1, STEPS + 1)), o
    for step in range(1, STEPS + 1):
        _assert_holds(str(tmp_path / f"step-{step}"), step)


def test_a_failed_second_save_is_raised_once_by_the_same_save_on_every_rank(tmp_path: Path) -> None:
    outcomes = _run(tmp_path, "second_fails")
    assert outcomes[1]["held_by_signal"] is True, outcomes  # the race the test sets up took place
    raised = [o["raised"] for o in outcomes]
    # step 2's failure: raised once, by step 4's save (the first save after it that every rank
    # knows it ended), alike on both ranks; the final wait raises nothing more
    assert [[step for step, _ in r] for r in raised] == [[4], [4]], raised
    for r in raised:
        assert r[0][1].startswith("CheckpointWriteError") and "No space left on device" in r[0][1], r
        assert "HINT:" in r[0][1], r
    assert outcomes[0]["order"] == [1, 3, 5]  # in step order; the failed one never committed
    assert not (tmp_path / "step-2" / "manifest.json").exists()
    assert not (tmp_path / "step-4").exists()  # the save that raised wrote nothing
    for step in (1, 3, 5):
        _assert_holds(str(tmp_path / f"step-{step}"), step)
