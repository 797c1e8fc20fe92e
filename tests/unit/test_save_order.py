"""Issue 56, "a save you can follow": what a save needs is one ``SaveOrder``, made where the save
is decided and passed down: through a real Trainer it reaches the plugin as ``storage_options``
(no attribute set beforehand on the saver or the engine), and the Saver acts on it alone."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyModel, loader
from trainers import make_trainer

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning, list_checkpoints
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage.store import Store


class RecordingIO(ShardedAsyncCheckpointIO):
    """The plugin, noting what Lightning hands it as ``storage_options`` and the order it makes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[Any, SaveOrder]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.seen.append((storage_options, self.order(path, storage_options)))
        super().save_checkpoint(checkpoint, path, storage_options)


def test_the_engines_orders_reach_the_plugin_through_lightning_and_others_get_one(tmp_path: Path) -> None:
    io = RecordingIO(storage_options={"auto_mkdir": True})
    callback = PreemptionCallback(str(tmp_path / "ck"), every_n_train_steps=2, keep_last_n=3, tuning=Tuning(lease=False))
    user = ModelCheckpoint(dirpath=str(tmp_path / "mc"), every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(5, [callback, user], plugins=[io])
    trainer.fit(TinyModel(), loader())

    engine = [(given, order) for given, order in io.seen if isinstance(given, SaveOrder)]
    assert [(o.kind, o.watched, Path(o.url).name) for _, o in engine] == [
        ("periodic", False, "step-0000000002"), ("periodic", False, "step-0000000004"),
        ("final", False, "step-0000000005"),
    ]  # fmt: skip
    assert all(o.options == {"auto_mkdir": True} and o.overlap == (o.kind != "final") for _, o in engine)
    others = [order for given, order in io.seen if not isinstance(given, SaveOrder)]
    assert [(o.kind, o.watched, Path(o.url).parent.name) for o in others] == [("user", True, "mc")]
    assert callback.engine.saving is None  # only while one is handed over
    # the kind each checkpoint records is its own order's, the user's save "periodic" as before
    committed = {c.step: c.path for c in list_checkpoints(str(tmp_path / "ck"))}
    kinds = {step: _callback_state(path)["kind"] for step, path in committed.items()}
    assert kinds == {2: "periodic", 4: "periodic", 5: "final"}


def _callback_state(path: str) -> dict[str, Any]:
    checkpoint = load_full_checkpoint(Store(path))
    return next(v for k, v in checkpoint["callbacks"].items() if "PreemptionCallback" in k)  # type: ignore[no-any-return]


def test_the_saver_stages_an_emergency_order_completely_and_a_periodic_one_late(tmp_path: Path) -> None:
    saver = Saver({}, overlap_staging=True)
    weight = torch.randn(256, 256)  # 256 KiB: deferrable
    saver.overlap.stable = lambda: [weight]
    saver.save({"state_dict": {"w": weight}, "global_step": 1}, SaveOrder(str(tmp_path / "e"), "emergency"))
    assert not saver.overlap.in_flight and saver.history[-1].deferred_bytes == 0
    saver.save({"state_dict": {"w": weight}, "global_step": 2}, SaveOrder(str(tmp_path / "p"), "periodic"))
    assert saver.history[-1].deferred_bytes == weight.numel() * 4
    saver.close()
    for name, step in (("e", 1), ("p", 2)):
        loaded = load_full_checkpoint(Store(str(tmp_path / name)))
        assert loaded["global_step"] == step and torch.equal(loaded["state_dict"]["w"], weight)


def test_an_unwatched_order_leaves_the_path_to_the_write_job(tmp_path: Path) -> None:
    saver, release = Saver({}), threading.Event()
    held = saver.submit(lambda: release.wait(30.0))  # the job thread is busy: the save's write waits
    url = str(tmp_path / "unwatched")
    saver.save({"state_dict": {"w": torch.ones(4)}, "global_step": 1}, SaveOrder(url, "periodic", watched=False))
    assert not Path(url).exists()  # a watched order's path exists here (test above: ModelCheckpoint's)
    release.set()
    held.result()
    saver.close()
    assert load_full_checkpoint(Store(url))["global_step"] == 1
