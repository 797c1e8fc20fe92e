"""The engine drives a hand-written training loop: no Lightning anywhere (docs/design.md, "The
engine's call order"). A real signal preempts the loop; the engine snapshots the agreed step,
exits with 143, and a fresh engine resumes there, ending bit-identical to a run without the
signal. This is the seam a front-end for Lightning Fabric builds on."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_preempt.catalog.goodput import summarize
from lightning_preempt.catalog.ledger_reader import read_ledger
from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.catalog.loader import Loader
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.engine.engine import Engine
from lightning_preempt.errors import CheckpointWriteError
from lightning_preempt.preemption.controller import Preempted
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver

STEPS = 12


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _run(dirpath: Path, *, signal_at: int | None = None) -> tuple[int, dict[str, torch.Tensor], list[int]]:
    """One process lifetime of a hand-written loop; returns (exit code, weights, steps trained)."""
    config = PreemptionConfig(dirpath=str(dirpath), every_n_train_steps=5, signals=("SIGUSR1",), lease=False,
                              agree_every_n_steps=1)  # fmt: skip
    engine, saver = Engine(config), Saver({})
    loader = Loader({}, verify_on_load=True, trust_checkpoints=False)
    model, opt = _model()
    state: dict[str, Any] = {"step": 0}

    def save(order: SaveOrder) -> None:
        checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                      "global_step": state["step"], "epoch": 0}  # fmt: skip
        saver.save(checkpoint, order)

    trained: list[int] = []
    code = 0
    engine.peek()  # before any process group, as a launcher would
    target = engine.setup(saver, save=save, route_saves=saver.enable_collective, leader=True)
    if target is not None:
        checkpoint = loader.load(target.path, trusted=False, group=None)
        model.load_state_dict(checkpoint["state_dict"])
        opt.load_state_dict(checkpoint["optimizer_states"][0])
        state["step"] = checkpoint["global_step"]
    try:
        engine.start(state["step"], loaded_from=loader.loaded_from)
        for x, y in _batches()[state["step"] :]:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            state["step"] += 1
            trained.append(state["step"])
            if state["step"] == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)  # a real signal; the handler only sets a flag
            engine.step_end(state["step"])
        engine.finish(state["step"])
    except Preempted as exit_:
        code = int(exit_.code or 0)
    finally:
        engine.close(finish_saves=True)
    return code, {k: v.clone() for k, v in model.state_dict().items()}, trained


def test_a_hand_written_loop_is_preempted_and_resumes_bit_identical(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr("lightning_preempt.engine.ledger_writer.PROGRESS_EVERY_S", 0.0)  # the last step seen, every step
    previous = signal.getsignal(signal.SIGUSR1)
    code, _, trained = _run(tmp_path / "preempted", signal_at=7)
    assert code == 143 and trained == list(range(1, 8))  # the signal's step was snapshotted, then exit
    assert signal.getsignal(signal.SIGUSR1) == previous  # the engine put the handler back
    steps = [c.step for c in list_checkpoints(str(tmp_path / "preempted")) if c.committed]
    assert steps == [7, 5]
    code, resumed, trained = _run(tmp_path / "preempted")
    assert code == 0 and trained == list(range(8, STEPS + 1))  # 0 steps lost, none repeated
    _, uninterrupted, _ = _run(tmp_path / "straight")
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
    committed = [c.step for c in list_checkpoints(str(tmp_path / "preempted")) if c.committed]
    assert committed == [12, 10]  # the final save; retention keeps the newest 2
    # the ledger (written by the engine, off the loop's thread) holds both processes of the run
    read = read_ledger(str(tmp_path / "preempted"))
    assert read.notes == [] and len(read.runs) == 1
    records = next(iter(read.runs.values())).records
    kinds = [(r["restart"], r["kind"], r.get("step", r.get("resumed_step"))) for r in records if r["kind"] != "progress"]
    assert kinds == [(0, "start", 0), (0, "save", 5), (0, "save", 7), (0, "preemption", 7),
                     (1, "start", 7), (1, "save", 10), (1, "save", 12), (1, "finish", 12)]  # fmt: skip
    saves = [r for r in records if r["kind"] == "save"]
    assert [r["save_kind"] for r in saves] == ["periodic", "emergency", "periodic", "final"]
    assert all(r["committed_s"] >= r["blocking_s"] > 0 and r["bytes"] > 0 and r["tier"] == "dirpath" for r in saves)
    preemption = next(r for r in records if r["kind"] == "preemption")
    assert preemption["source"] == "SIGUSR1" and preemption["committed"] and preemption["steps_lost"] == 0
    assert 0 < preemption["to_exit_s"] < 60
    # the signal came during step 7 (after step 6 ended) and was agreed at step 7's boundary
    assert preemption["agreed_after_steps"] == 1 and 0 <= preemption["agreed_after_s"] < preemption["to_exit_s"]
    summary = summarize(records)
    assert [p["agreed_after_steps"] for p in summary["preemptions"]] == [1]
    assert summary["restarts"] == 1 and summary["finished"] and summary["last_step"] == 12
    assert [p["steps_lost"] for p in summary["preemptions"]] == [0] and summary["steps_trained"] == 12
    assert 0 < summary["goodput"] <= 1


def test_a_failed_save_stops_the_loop_with_the_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    dirpath = tmp_path / "file" / "ckpts"  # every write under it fails, for root too
    config = PreemptionConfig(dirpath=str(dirpath), every_n_train_steps=1, lease=False, probe_storage=False)
    engine, saver = Engine(config), Saver({})

    def save(order: SaveOrder) -> None:
        saver.save({"state_dict": {"w": torch.ones(2)}, "global_step": 1, "epoch": 0}, order)

    engine.setup(saver, save=save, route_saves=saver.enable_collective, leader=True)
    engine.start(0, loaded_from=None)
    try:
        engine.step_end(1)  # accepted: the write fails in the background
        with pytest.raises(CheckpointWriteError, match="ckpts") as err:
            engine.step_end(2)  # the next boundary stops the loop with that failure
        assert "HINT:" in str(err.value)
        assert not dirpath.exists()
    finally:
        engine.close(finish_saves=True)


def test_without_an_interval_a_warning_says_what_a_sigkill_loses_once(tmp_path: Path) -> None:
    def fit(engine: Engine, saver: Saver) -> None:
        engine.setup(saver, save=lambda order: None, route_saves=saver.enable_collective, leader=True)
        engine.start(7, loaded_from=None)
        engine.close(finish_saves=True)

    config = PreemptionConfig(dirpath=str(tmp_path / "ck"), lease=False, grace_period_s=45)
    engine, saver = Engine(config), Saver({})
    with pytest.warns(UserWarning, match="no periodic saves") as seen:
        fit(engine, saver)
        fit(engine, saver)  # the same callback fitted again: said once
    texts = [str(w.message) for w in seen if "no periodic saves" in str(w.message)]
    assert len(texts) == 1
    assert "since step 7" in texts[0] and "grace_period_s=45" in texts[0] and "SIGTERM" in texts[0]
    assert "HINT: set every_n_train_steps=N or every_n_seconds=S" in texts[0] and "lightning-preempt plan" in texts[0]

    timed = Engine(PreemptionConfig(dirpath=str(tmp_path / "ck2"), lease=False, every_n_seconds=600.0))
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        fit(timed, Saver({}))
    assert not [w for w in quiet if "no periodic saves" in str(w.message)]


def test_an_agreed_error_ends_the_run_in_the_ledger_once(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    config = PreemptionConfig(dirpath=str(tmp_path / "ck"), every_n_train_steps=1, lease=False)
    engine, saver = Engine(config), Saver({})

    def save(order: SaveOrder) -> None:  # the checkpoint's write fails in the background; the ledger's do not
        saver.save({"state_dict": {"w": torch.ones(2)}, "global_step": 1, "epoch": 0},
                   SaveOrder(str(tmp_path / "file" / "x")))

    engine.setup(saver, save=save, route_saves=saver.enable_collective, leader=True)
    engine.start(0, loaded_from=None)
    engine.step_end(1)
    with pytest.raises(CheckpointWriteError) as err:
        engine.step_end(2)
    engine.close(finish_saves=True, error=err.value)  # the front-end's exception hook reports it again
    records = [r for r in next(iter(read_ledger(str(tmp_path / "ck")).runs.values())).records if r["kind"] != "progress"]
    assert [r["kind"] for r in records] == ["start", "save", "error"]
    assert records[1]["committed_s"] is None and records[1]["error"]
    assert records[2]["error"].startswith("CheckpointWriteError: ") and records[2]["step"] == 2
    summary = summarize(records)
    assert summary["preemptions"] == [] and not summary["finished"] and summary["segments"][0]["end"] == "error"
