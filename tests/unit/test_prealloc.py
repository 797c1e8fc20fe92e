"""Staging buffers allocated ahead of the first save: the save then only copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_preempt.format.shares import own_share, replica_owners
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.lightning.staging_hooks import prepare_staging
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.staging.stager import HostStager
from lightning_preempt.storage.store import Store


def test_prepared_buffers_are_the_ones_stage_fills() -> None:
    stager = HostStager(pin_memory=False)
    tensors = {"a": torch.randn(100, 10), "b": torch.arange(7)}
    assert stager.prepare(tensors, background=True).result() == 100 * 10 * 4 + 7 * 8
    ptrs = {k: b.data_ptr() for k, b in stager._buffers.items()}
    staged = stager.stage(tensors)
    assert {k: t.data_ptr() for k, t in staged.items()} == ptrs  # no allocation inside the save
    assert stager.allocated_bytes == 100 * 10 * 4 + 7 * 8
    assert torch.equal(staged["a"], tensors["a"]) and torch.equal(staged["b"], tensors["b"])


def test_prepare_again_adds_only_what_grew() -> None:
    stager = HostStager(pin_memory=False)
    stager.prepare({"a": torch.zeros(10)}, background=False).result()
    kept = stager._buffers["a"].data_ptr()
    added = stager.prepare({"a": torch.zeros(10), "b": torch.zeros(5), "c": torch.zeros(3)}, background=True).result()
    assert added == (5 + 3) * 4 and stager._buffers["a"].data_ptr() == kept
    assert stager.prepare({"a": torch.zeros(20)}, background=False).result() == 80  # shape changed: replaced


def test_stage_during_preparation_waits_instead_of_allocating_twice() -> None:
    stager = HostStager(pin_memory=False)
    tensors = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(16)}
    stager.prepare(tensors, background=True)
    staged = stager.stage(tensors)  # typically while the thread still allocates
    assert stager.allocated_bytes == 16 * (1 << 18) * 4
    assert all(torch.equal(staged[k], t) for k, t in tensors.items())


def test_plugin_first_save_after_prepare_allocates_nothing(tmp_url: str) -> None:
    io = ShardedAsyncCheckpointIO()
    ckpt: dict[str, Any] = {
        "global_step": 3,
        "state_dict": {"w": torch.randn(32, 8)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(32, 8)}}, "param_groups": []}],
    }
    io.prepare_staging(ckpt).result()
    before = io.staging_allocated_bytes
    io.save_checkpoint(ckpt, tmp_url)
    io.wait()
    assert io.staging_allocated_bytes == before == 2 * 32 * 8 * 4
    assert torch.equal(load_full_checkpoint(Store(tmp_url))["state_dict"]["w"], ckpt["state_dict"]["w"])


def test_owners_balance_bytes_and_cover_every_tensor_once() -> None:
    tensors = {f"k{i}": torch.zeros(10 * (i + 1)) for i in range(9)}
    owners = replica_owners(tensors, 2)
    shares = [own_share(tensors, r, 2) for r in range(2)]
    assert set(shares[0]) | set(shares[1]) == set(tensors) and not set(shares[0]) & set(shares[1])
    sizes = [sum(t.numel() for t in s.values()) for s in shares]
    assert max(sizes) <= 0.6 * sum(sizes)
    assert owners == replica_owners(dict(reversed(list(tensors.items()))), 2)  # order does not matter


class _Adam(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(8, 16))
        return torch.utils.data.DataLoader(data, batch_size=2)


class _Probe(pl.Callback):
    """Prepares at on_train_start and after the first step (Adam's state appears there),
    the way PreemptionCallback does, and records the staging memory at each point."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        io = trainer.strategy.checkpoint_io
        fut = prepare_staging(trainer, io)
        assert fut is not None
        fut.result()
        self.seen["start"] = io.staging_allocated_bytes

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        io = trainer.strategy.checkpoint_io
        if trainer.global_step == 1:
            fut = prepare_staging(trainer, io)
            assert fut is not None
            fut.result()
            self.seen["after_step_1"] = io.staging_allocated_bytes
        if trainer.global_step == 2:
            trainer.save_checkpoint(str(Path(trainer.default_root_dir) / "ckpt"))
            io.wait()
            self.seen["after_save"] = io.staging_allocated_bytes


def test_trainer_state_preallocated_before_the_first_save(tmp_path: Path) -> None:
    probe = _Probe()
    trainer = pl.Trainer(
        default_root_dir=str(tmp_path),
        max_steps=2,
        plugins=[ShardedAsyncCheckpointIO()],
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Adam())
    params = (16 * 4 + 4) * 4
    assert probe.seen["start"] == params  # Adam has no state before its first step
    # exp_avg + exp_avg_sq per parameter, plus the step counters
    assert probe.seen["after_step_1"] > 3 * params
    assert probe.seen["after_save"] == probe.seen["after_step_1"]  # the save allocated nothing


def test_staging_copies_every_kind_of_tensor_in_one_call(monkeypatch: Any) -> None:
    """One ``_foreach_copy_`` for the whole state (issue 26): parameters that need grad,
    non-contiguous, 0-dim, bfloat16 and empty tensors land in contiguous buffers, exactly."""
    from lightning_preempt.staging import stager as staging

    calls: list[int] = []
    real = staging.copy_all

    def counting(buffers: list[torch.Tensor], sources: list[torch.Tensor], **kw: Any) -> None:
        calls.append(len(buffers))
        real(buffers, sources, **kw)

    monkeypatch.setattr(staging, "copy_all", counting)
    src = {
        "param": torch.nn.Parameter(torch.randn(3, 4)),
        "transposed": torch.randn(4, 3).t(),
        "scalar": torch.tensor(5, dtype=torch.int64),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.zeros(0),
    }
    stager = staging.HostStager(pin_memory=False)
    for _ in range(2):  # allocating, then reusing the buffers
        staged = stager.stage(src)
        for key, tensor in src.items():
            assert torch.equal(staged[key], tensor.detach()) and staged[key].is_contiguous(), key
            assert not staged[key].requires_grad, key
    assert [c for c in calls if c] == [5, 5]
