"""Overlapped staging (staging/overlap.py) on the CPU thread path, in real Trainer runs: the copy
of every periodic save is held until the next optimizer step's backward is done, so that
step's forward and backward certainly run during it; the committed snapshot of step k must
still equal step k's state bit for bit."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, TensorDataset
from trainers import make_trainer

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning, list_checkpoints
from lightning_preempt.errors import CheckpointWriteError
from lightning_preempt.preemption.controller import Preempted
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.staging import overlap
from lightning_preempt.storage.store import Store


class Hold:
    """Holds the helper thread's copy until the gate waits for it: it then certainly runs
    after step k+1's forward and backward, and before its update. Were there no gate, the
    copy would be let go after the optimizer step instead (and copy step k+1's values)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting = False
        self.released_by: list[str] = []
        self.timed_out = False

    def copy(self, pairs: overlap.Pairs, real: Any) -> None:
        self.waiting = True
        if not self.release.wait(30):  # a bug, not a slow machine: fail instead of hanging
            self.timed_out = True
        self.waiting = False
        self.release.clear()
        real(pairs)

    def let_go(self, by: str) -> None:
        if self.waiting and not self.release.is_set():
            self.released_by.append(by)
            self.release.set()


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hold]:
    h = Hold()
    real_copy, real_gate = overlap.copy_on_thread, overlap.InFlightCopy.gate

    def gate(self: overlap.InFlightCopy) -> None:
        h.let_go("gate")
        real_gate(self)

    monkeypatch.setattr(overlap, "copy_on_thread", lambda pairs: h.copy(pairs, real_copy))
    monkeypatch.setattr(overlap.InFlightCopy, "gate", gate)
    handle = register_optimizer_step_post_hook(lambda *_: h.let_go("after the optimizer step"))
    yield h
    handle.remove()


class BNModel(L.LightningModule):
    """Buffers the forward changes (BatchNorm) and parameters large enough to be deferred."""

    def __init__(self, optimizer: str, probe: Probe, manual: bool = False) -> None:
        super().__init__()
        self.probe = probe
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))  # fmt: skip
        self.optimizer = optimizer
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        self.probe.backward_done(self.trainer)
        opt.step()  # type: ignore[union-attr]
        return None

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _loader(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n * 8, 64, generator=g), torch.randn(n * 8, 1, generator=g)), batch_size=8)


def _state(module: L.LightningModule, trainer: L.Trainer) -> dict[str, torch.Tensor]:
    out = {f"w/{k}": v.detach().clone() for k, v in module.state_dict().items()}
    for pid, st in trainer.optimizers[0].state_dict()["state"].items():
        out.update({f"o/{pid}/{k}": v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _loaded(path: str) -> dict[str, torch.Tensor]:
    ck = load_full_checkpoint(Store(path))
    out = {f"w/{k}": v for k, v in ck["state_dict"].items()}
    for pid, st in ck["optimizer_states"][0]["state"].items():
        out.update({f"o/{pid}/{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


class Probe(Callback):
    """Records step k's state at every step, and counts the batches whose forward and
    backward ran while a copy was in flight."""

    def __init__(self, io: ShardedAsyncCheckpointIO, accumulate: int, signal_at: int | None) -> None:
        self.io, self.accumulate, self.signal_at = io, accumulate, signal_at
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.batches_during_copy = 0
        self.released_in_flight = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        # The first batch end of each step is the one saved (later ones: micro-batches of the next step)
        if trainer.global_step not in self.states:
            self.states[trainer.global_step] = _state(pl_module, trainer)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.io.saver.overlap.in_flight:
            self.batches_during_copy += 1
            if trainer.global_step + 1 == self.signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)  # the signal arrives while the copy is in flight

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            return  # manual_backward: training_step releases just before its opt.step()
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready % self.accumulate:
            return  # mid accumulation: no optimizer step follows this backward
        self.backward_done(trainer)

    def backward_done(self, trainer: L.Trainer) -> None:
        if self.io.saver.overlap.in_flight:  # backward done, the update next: the copy is still held
            self.released_in_flight += 1


def _fit(root: str, hold: Hold, optimizer: str, accumulate: int, *, steps: int = 5, manual: bool = False,
         signal_at: int | None = None) -> tuple[Probe, ShardedAsyncCheckpointIO, int]:  # fmt: skip
    torch.manual_seed(0)
    io = ShardedAsyncCheckpointIO(tuning=Tuning(overlap_staging=True))
    probe = Probe(io, accumulate, signal_at)
    cb = PreemptionCallback(root, every_n_train_steps=2, keep_last_n=5, tuning=Tuning(
        signals=("SIGUSR1",), lease=False, probe_storage=False, agree_every_n_steps=1, overlap_agreement=False))  # fmt: skip
    # Lightning moves the checkpoint callback (cb) last: the probe sees each step before it saves
    trainer = make_trainer(steps, [probe, cb], plugins=[io], accumulate_grad_batches=1 if manual else accumulate)
    code = 0
    try:
        trainer.fit(BNModel(optimizer, probe, manual), _loader(steps * accumulate))
    except Preempted as exit_:
        code = int(exit_.code or 0)
    assert not hold.timed_out
    assert hold.released_by == ["gate"] * len(hold.released_by)  # not one update ran before its copy
    return probe, io, code


def _assert_committed_equal(root: str, probe: Probe, steps: list[int]) -> None:
    committed = sorted((c.step, c.path) for c in list_checkpoints(root) if c.committed)
    assert [s for s, _ in committed] == steps
    for step, path in committed:
        loaded, expected = _loaded(path), probe.states[step]
        assert loaded.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), (step, key)  # bit for bit


@pytest.mark.parametrize(
    ("optimizer", "accumulate"),
    [("sgd", 1), ("adamw", 4), pytest.param("adamw", 1, marks=pytest.mark.slow), pytest.param("sgd", 4, marks=pytest.mark.slow)],
)
def test_snapshot_is_step_k_while_step_k_plus_1_runs(memory_url: str, hold: Hold, optimizer: str, accumulate: int) -> None:
    probe, io, code = _fit(memory_url, hold, optimizer, accumulate)
    assert code == 0 and len(hold.released_by) == 2
    overlapped = [r for r in io.history if r.deferred_bytes]
    assert [r.step for r in overlapped] == [2, 4]  # the final save (5) is staged synchronously
    assert all(r.deferred_bytes >= 2 * 256 * 256 * 4 for r in overlapped)  # parameters and state went late
    # every batch of the step after each save ran (forward and backward) while its copy was held
    assert probe.batches_during_copy == 2 * accumulate and probe.released_in_flight == 2
    _assert_committed_equal(memory_url, probe, [2, 4, 5])


def test_manual_optimization_waits_in_the_optimizer_hook(memory_url: str, hold: Hold) -> None:
    probe, _, code = _fit(memory_url, hold, "sgd", 1, manual=True)
    assert code == 0 and probe.batches_during_copy == 2 and probe.released_in_flight == 2
    _assert_committed_equal(memory_url, probe, [2, 4, 5])


def test_emergency_during_an_inflight_copy_commits_the_right_steps(memory_url: str, hold: Hold) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        probe, io, code = _fit(memory_url, hold, "adamw", 1, steps=8, signal_at=5)
    finally:
        # The Trainer's Preempted exit leaves the callback's (inactive) handler behind; a
        # later SIGUSR1 in this process would then take the default action and kill pytest.
        signal.signal(signal.SIGUSR1, previous)
    assert code == 143
    assert probe.batches_during_copy == 2  # steps 3 and 5 ran during the copies of 2 and 4
    assert [(r.step, bool(r.deferred_bytes)) for r in io.history] == [(2, True), (4, True), (5, False)]
    _assert_committed_equal(memory_url, probe, [2, 4, 5])  # 5: the emergency snapshot, staged synchronously


def test_a_plain_loop_optimizer_step_waits_for_the_copy(tmp_path: Path, hold: Hold) -> None:
    """No Trainer, no closure: the optimizer's step pre-hook alone is the gate."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    saver = Saver({}, overlap_staging=True)
    saver.overlap.stable = lambda: [*model.parameters(), *(t for s in opt.state.values() for t in s.values())]
    x, y = torch.randn(8, 64), torch.randn(8, 1)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    saver.save({"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 1},
               SaveOrder(str(tmp_path / "one")))  # fmt: skip
    step()  # forward and backward run during the held copy; the update waits in the hook
    assert hold.released_by == ["gate"] and not saver.overlap.in_flight
    expected2 = {k: v.clone() for k, v in model.state_dict().items()}
    saver.save({"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 2},
               SaveOrder(str(tmp_path / "two")))  # fmt: skip
    during: list[bool] = []

    def closure() -> torch.Tensor:  # a closure given by position: the wait comes after it
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        during.append(saver.overlap.in_flight)
        return loss

    opt.step(closure)
    assert during == [True] and hold.released_by == ["gate", "gate"]
    saver.close()
    for name, want in (("one", expected), ("two", expected2)):
        loaded = load_full_checkpoint(Store(str(tmp_path / name)))["state_dict"]
        assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], v) for k, v in want.items())
    assert not torch.equal(model.state_dict()["0.weight"], expected2["0.weight"])  # step 3 did change it


def test_an_inplace_change_during_the_copy_fails_the_save(tmp_path: Path, hold: Hold) -> None:
    """The rule's safety net: a parameter changed in place (not through ``.data``) while its
    copy ran is caught, and the save is not committed."""
    saver = Saver({}, overlap_staging=True)
    weight = torch.randn(256, 256)
    saver.overlap.stable = lambda: [weight]
    saver.save({"state_dict": {"w": weight}, "global_step": 1}, SaveOrder(str(tmp_path / "a")))
    assert saver.overlap.in_flight
    weight.add_(1.0)  # what the rule forbids: a change outside an optimizer step, before settle()
    hold.release.set()
    with pytest.raises(CheckpointWriteError, match="changed in place") as err:
        saver.wait()
    assert "HINT:" in str(err.value)
    assert not list_checkpoints(str(tmp_path))
    saver.close()


def test_a_save_that_streams_over_the_budget_is_not_overlapped(tmp_path: Path) -> None:
    """Over host_memory_budget the save blocks until the streamed part is written anyway: it
    stages the rest completely, and the checkpoint is exact."""
    saver = Saver({}, overlap_staging=True, host_memory_budget=1 << 20)
    weights = {f"w{i}": torch.randn(256, 512) for i in range(4)}  # 2 MiB, 512 KiB each
    saver.overlap.stable = lambda: weights.values()
    saver.save({"state_dict": weights, "global_step": 1}, SaveOrder(str(tmp_path / "a")))
    assert not saver.overlap.in_flight and saver.history[-1].deferred_bytes == 0
    saver.close()
    loaded = load_full_checkpoint(Store(str(tmp_path / "a")))["state_dict"]
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
