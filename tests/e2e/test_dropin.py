"""The plugin as a drop-in CheckpointIO: what Lightning users do with checkpoints keeps working.

Issue 12, points 1-7: pickling (ddp_spawn, deepcopy), replacing a checkpoint at the same
path (crash-safe at every moment), the path existing when ``save_checkpoint`` returns,
removing any kind of entry, ``FileNotFoundError`` for a missing path, and synchronous
saves outside ``fit``. Real ``Trainer``, ``ModelCheckpoint`` and ``load_from_checkpoint``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from ckpts import assert_same, committed_names, lightning_like_checkpoint
from crash_fs import CrashFileSystem, SimulatedCrash
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from models import TinyModel, data, loader
from torch.utils.data import DataLoader
from trainers import StartProbe, make_trainer

from lightning_preempt import (
    CheckpointError,
    CheckpointNotFoundError,
    NotACheckpointError,
    PreemptionCallback,
    ShardedAsyncCheckpointIO,
    list_checkpoints,
)
from lightning_preempt.format.names import MANIFEST_NAME


def _our_threads(before: set[threading.Thread]) -> list[str]:
    """Our threads started since ``before`` and still alive."""
    return [t.name for t in set(threading.enumerate()) - before if t.name.startswith("lightning_preempt")]


# ---- 1. pickling -------------------------------------------------------------------------
def test_a_trainer_with_the_plugin_pickles_and_its_callbacks_deepcopy(tmp_path: Path) -> None:
    io = ShardedAsyncCheckpointIO()
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", save_last=True, every_n_train_steps=2)
    trainer = make_trainer(
        4, [mc, PreemptionCallback(str(tmp_path / "pre"), every_n_train_steps=2)], plugins=[io], root=tmp_path
    )
    pickle.dumps(trainer)  # before fit: nothing started yet
    trainer.fit(TinyModel(), loader(4))
    assert io.staging_allocated_bytes > 0 and io.history  # it did save, with buffers and records
    copies = copy.deepcopy(trainer.callbacks)
    assert [type(c) for c in copies] == [type(c) for c in trainer.callbacks]
    loop = copy.deepcopy(trainer.fit_loop)  # a loop references the trainer, hence the plugin
    assert loop.epoch_loop.global_step == 4
    restored = pickle.loads(pickle.dumps(trainer))
    clone = restored.strategy.checkpoint_io
    assert isinstance(clone, ShardedAsyncCheckpointIO) and clone is not io
    assert clone.staging_allocated_bytes == 0 and clone.history == []  # runtime state stays behind
    # The copy works on its own: a save, a replacement and a load.
    clone.enable_collective_saves(None)
    for step in (7, 8):
        clone.save_checkpoint(lightning_like_checkpoint(step=step), str(tmp_path / "copy"))
    clone.wait()
    assert_same(lightning_like_checkpoint(step=8), clone.load_checkpoint(str(tmp_path / "copy")))
    clone.teardown()


class StartStepFile(Callback):
    """Writes the step training starts at (worker processes cannot report back otherwise)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(str(trainer.global_step))


@pytest.mark.slow  # ~28 s: 3 spawned 2-rank fits (the test-time budget); DDP is covered fast elsewhere
def test_ddp_spawn_trains_saves_and_resumes(tmp_path: Path) -> None:
    """ddp_spawn pickles the plugin into 2 worker processes; they save (replacing
    last.ckpt), the parent loads the workers' final weights through its own copy."""

    def run(max_steps: int, ckpt_path: str | None) -> TinyModel:
        L.seed_everything(0)
        model = TinyModel()
        mc = ModelCheckpoint(dirpath=tmp_path / "mc", save_last=True, every_n_train_steps=2, save_top_k=0)
        start = StartStepFile(str(tmp_path / "start"))
        # PreemptionCallback first: ddp_spawn hands best_model_path back to the first one.
        pre = PreemptionCallback(str(tmp_path / "pre"), every_n_train_steps=2)
        trainer = make_trainer(max_steps, [pre, mc, start], strategy="ddp_spawn", devices=2, root=tmp_path)
        trainer.fit(model, loader(8), ckpt_path=ckpt_path)
        return model

    before = set(threading.enumerate())
    model = run(4, None)
    assert _our_threads(before) == []  # the parent loaded and removed the weights file synchronously
    last = str(tmp_path / "mc" / "last.ckpt")  # (ddp_spawn returns no last_model_path to the parent)
    saved = ShardedAsyncCheckpointIO().load_checkpoint(last)
    assert saved["global_step"] == 4
    # The parent got the workers' weights (saved and loaded through the plugin, then removed).
    for k, v in saved["state_dict"].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert [c.name for c in list_checkpoints(str(tmp_path / "mc"))] == ["last.ckpt"]

    assert (tmp_path / "start").read_text() == "0"
    assert committed_names(tmp_path / "pre") == [("step-0000000004", 4), ("step-0000000002", 2)]
    run(6, last)  # resume in ddp_spawn from the replaced last.ckpt
    assert (tmp_path / "start").read_text() == "4"
    assert committed_names(tmp_path / "pre")[0] == ("step-0000000006", 6)
    resumed = ShardedAsyncCheckpointIO().load_checkpoint(last)
    assert resumed["global_step"] == 6
    assert resumed["optimizer_states"][0]["state"][0]["step"].item() == 6


# ---- 2. replacing a checkpoint at the same path -------------------------------------------
def test_save_last_replaces_last_ckpt_every_time(tmp_path: Path) -> None:
    mc = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2, save_top_k=0)
    make_trainer(6, [mc], root=tmp_path).fit(TinyModel(), loader(4))
    assert committed_names(tmp_path) == [("last.ckpt", 6)]
    assert ShardedAsyncCheckpointIO().load_checkpoint(str(tmp_path / "last.ckpt"))["global_step"] == 6


@pytest.mark.parametrize(
    "kwargs",
    [
        {"filename": "fixed", "enable_version_counter": False, "save_top_k": -1},
        {"filename": "fixed", "monitor": None, "save_top_k": 1},
    ],
    ids=["no-version-counter", "monitor-none-top1"],
)
def test_a_fixed_filename_is_replaced_in_place(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    mc = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, **kwargs)
    make_trainer(6, [mc], root=tmp_path).fit(TinyModel(), loader(4))
    assert committed_names(tmp_path) == [("fixed.ckpt", 6)]
    assert mc.best_model_path == str(tmp_path / "fixed.ckpt")


def test_rerunning_fit_into_the_same_folder_names_files_as_lightning_does(tmp_path: Path) -> None:
    """Two runs into one folder, with our plugin and with Lightning's own: the same names
    (``-v1`` versions because the path exists when the save returns; last.ckpt replaced)."""

    def two_runs(root: Path, plugins: list[Any]) -> list[str]:
        for _ in range(2):
            mc = ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=2, save_top_k=-1)
            make_trainer(4, [mc], plugins=[type(p)() for p in plugins], root=tmp_path).fit(TinyModel(), loader(4))
        return sorted(os.listdir(root))

    ours = two_runs(tmp_path / "ours", [ShardedAsyncCheckpointIO()])
    theirs = two_runs(tmp_path / "theirs", [TorchCheckpointIO()])
    assert ours == theirs
    assert "epoch=0-step=2-v1.ckpt" in ours
    assert {name: step for name, step in committed_names(tmp_path / "ours")}["last.ckpt"] == 4


class LoggingModel(TinyModel):
    """Logs the step as a metric, so ModelCheckpoint(monitor=...) ranks checkpoints."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.log("metric", float(self.global_step % 3))
        return super().training_step(batch, batch_idx)


MC_MATRIX = {
    "top2-monitor": {"monitor": "metric", "save_top_k": 2},
    "top1-monitor-last": {"monitor": "metric", "save_top_k": 1, "save_last": True},
    "all-last-link": {"save_top_k": -1, "save_last": "link"},
    "top1-no-monitor-fixed": {"save_top_k": 1, "filename": "fixed"},
    "no-version-counter": {"save_top_k": -1, "filename": "x", "enable_version_counter": False},
    "top0-last": {"save_top_k": 0, "save_last": True},
}


_ALWAYS = ("top2-monitor", "all-last-link", "no-version-counter")  # the rest: CI samples them (slow)


@pytest.mark.parametrize(
    "config", [pytest.param(c, id=c, marks=() if c in _ALWAYS else pytest.mark.slow) for c in MC_MATRIX]
)
def test_model_checkpoint_keeps_what_it_keeps_with_torch_checkpoint_io(tmp_path: Path, config: str) -> None:
    """Lightning's own plugin is the standard: the same ModelCheckpoint settings, two runs
    into one folder, leave the same names, best/last paths and steps with our plugin."""

    def two_runs(root: Path, plugin_type: type) -> tuple[list[str], dict[str, Any], dict[str, int]]:
        for _ in range(2):
            L.seed_everything(0)
            mc = ModelCheckpoint(dirpath=root, every_n_train_steps=2, **MC_MATRIX[config])  # type: ignore[arg-type]
            make_trainer(6, [mc], plugins=[plugin_type()], root=tmp_path).fit(LoggingModel(), loader(8))
        paths = {"best": os.path.basename(mc.best_model_path), "last": os.path.basename(mc.last_model_path)}
        reader = ShardedAsyncCheckpointIO(trust_checkpoints=True)
        steps = {
            name: reader.load_checkpoint(str(root / name))["global_step"]
            for name in os.listdir(root)
            if os.path.exists(root / name)  # (a dangling link is compared by name only)
        }
        return sorted(os.listdir(root)), paths, steps

    theirs = two_runs(tmp_path / "theirs", TorchCheckpointIO)
    ours = two_runs(tmp_path / "ours", ShardedAsyncCheckpointIO)
    assert ours == theirs


def test_ckpt_path_last_and_best_resolve_to_our_checkpoints(tmp_path: Path) -> None:
    def with_top1_and_last(max_steps: int, probe: Callback) -> L.Trainer:
        mc = ModelCheckpoint(dirpath=tmp_path, monitor="metric", save_last=True, every_n_train_steps=2)
        return make_trainer(max_steps, [mc, probe], root=tmp_path)

    with_top1_and_last(4, StartProbe()).fit(LoggingModel(), loader(8))
    probe = StartProbe()
    second = with_top1_and_last(6, probe)
    second.fit(LoggingModel(), loader(8), ckpt_path="last")  # Lightning finds last.ckpt itself
    assert probe.start_step == 4
    best = second.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    assert best and os.path.isdir(best)
    second.validate(LoggingModel(), DataLoader(data(32, seed=1), batch_size=16), ckpt_path="best")
    assert second.strategy.checkpoint_io.load_checkpoint(best)["global_step"] in (2, 4, 6)


SCENARIOS = ["dir-to-dir", "generation-to-generation", "file-to-dir", "dir-to-file"]


def _prepare(scenario: str, url: str) -> tuple[ShardedAsyncCheckpointIO, int]:
    """Put the old checkpoint at ``url``; returns a plugin and the old step."""
    io = ShardedAsyncCheckpointIO()
    if scenario == "file-to-dir":
        CrashFileSystem().pipe_file(url, _torch_bytes(lightning_like_checkpoint(step=1)))
        return io, 1
    io.save_checkpoint(lightning_like_checkpoint(step=1), url)
    if scenario == "generation-to-generation":
        io.save_checkpoint(lightning_like_checkpoint(step=2), url)
        io.wait()
        return io, 2
    io.wait()
    return io, 1


def _torch_bytes(obj: Any) -> bytes:
    import io as _io

    buffer = _io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _replace(scenario: str, io: ShardedAsyncCheckpointIO, url: str) -> None:
    if scenario == "dir-to-file":
        io.teardown()  # outside fit: a synchronous plain file
    io.save_checkpoint(lightning_like_checkpoint(step=9), url)
    io.wait()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_crash_at_any_moment_of_a_replacement_leaves_one_complete_checkpoint(scenario: str) -> None:
    url = "crashfs://run/last.ckpt"
    CrashFileSystem.reset()
    io, old_step = _prepare(scenario, url)
    CrashFileSystem.arm(None)
    _replace(scenario, io, url)
    moments = list(CrashFileSystem.moments)
    assert len(moments) > 3, moments

    seen = []
    for crash_at in range(len(moments) + 1):
        CrashFileSystem.reset()
        io, _ = _prepare(scenario, url)
        CrashFileSystem.arm(crash_at)
        with contextlib.suppress(SimulatedCrash, CheckpointError):
            _replace(scenario, io, url)
        with contextlib.suppress(CheckpointError):
            io.teardown()  # the "dead" process's thread; its store operations all fail
        CrashFileSystem.arm(None)  # "restart": a new process, a new plugin
        fresh = ShardedAsyncCheckpointIO()
        try:
            loaded = fresh.load_checkpoint(url)
        except NotACheckpointError:
            # Only a change of kind (file <-> directory) on a file system, between its two
            # renames (local disk: an instant): the complete checkpoint is beside the path.
            assert scenario in ("file-to-dir", "dir-to-file"), (crash_at, moments[crash_at])
            beside = [p for p in CrashFileSystem().ls("run", detail=False) if ".last.ckpt.lp-" in p]
            complete = []
            for sibling in beside:
                try:
                    complete.append(fresh.load_checkpoint(f"crashfs://{sibling}")["global_step"])
                except (CheckpointError, OSError, RuntimeError):  # a partial temp file
                    continue
            assert complete and set(complete) <= {old_step, 9}, (crash_at, moments[crash_at], beside)
            seen.append(None)
        else:
            step = loaded["global_step"]
            assert step in (old_step, 9), (crash_at, moments[crash_at])
            assert_same(lightning_like_checkpoint(step=step), loaded)  # complete, never a mix
            seen.append(step)
        # The path stays usable: the next save replaces whatever the crash left, and clears it.
        fresh.save_checkpoint(lightning_like_checkpoint(step=11), url)
        fresh.wait()
        assert fresh.load_checkpoint(url)["global_step"] == 11
        assert [p for p in CrashFileSystem().ls("run", detail=False) if ".last.ckpt.lp-" in p] == []
        fresh.teardown()
    # Old until the commit, new from then on: exactly one switch.
    steps = [s for s in seen if s is not None]
    assert steps[0] == old_step and steps[-1] == 9
    assert steps == sorted(steps, key=lambda s: s == 9), seen


_REPLACE_FOREVER = """
import sys
sys.path.insert(0, {tests!r})
from ckpts import lightning_like_checkpoint
from lightning_preempt import ShardedAsyncCheckpointIO
io = ShardedAsyncCheckpointIO()
step = 0
while True:
    step += 1
    io.save_checkpoint(lightning_like_checkpoint(step=step, width=20000), {path!r})
    io.wait()
    print("committed", step, flush=True)
"""


@pytest.mark.slow
def test_sigkill_while_replacing_on_local_disk_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """A real process replacing one path over and over, SIGKILLed at random moments."""
    import random
    import signal
    import subprocess
    import sys

    path = str(tmp_path / "last.ckpt")
    code = _REPLACE_FOREVER.format(tests=str(Path(__file__).resolve().parents[1] / "support"), path=path)
    rng = random.Random(12)
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        last = 0
        for line in proc.stdout:
            last = int(line.split()[1])
            if last >= 2 + rng.randrange(3):  # a few replacements in
                break
        threading.Event().wait(rng.uniform(0.0, 0.2))  # somewhere inside the next save
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        loaded = ShardedAsyncCheckpointIO().load_checkpoint(path)
        assert loaded["global_step"] >= last  # nothing committed was lost
        assert_same(lightning_like_checkpoint(step=loaded["global_step"], width=20000), loaded)


def test_a_replacement_leaves_no_stale_files(tmp_path: Path) -> None:
    io = ShardedAsyncCheckpointIO()
    path = tmp_path / "last.ckpt"
    for step in (1, 2, 3):
        io.save_checkpoint(lightning_like_checkpoint(step=step), str(path))
    io.wait()
    names = sorted(os.listdir(path))
    assert names[0] == MANIFEST_NAME and len(names) == 2 and names[1].startswith("v-"), names
    # The verifier and the listing resolve the generation like the loader does.
    from lightning_preempt.read.verify import verify_checkpoint
    from lightning_preempt.storage.store import Store

    assert verify_checkpoint(Store(str(path))).step == 3
    assert committed_names(tmp_path) == [("last.ckpt", 3)]
    io.teardown()


def test_a_replaced_checkpoint_drains_to_another_store(tmp_path: Path) -> None:
    from lightning_preempt.storage.store import Store
    from lightning_preempt.tiers.drain import drain_checkpoint

    io = ShardedAsyncCheckpointIO()
    for step in (1, 2):
        io.save_checkpoint(lightning_like_checkpoint(step=step), str(tmp_path / "last.ckpt"))
    io.teardown()
    drain_checkpoint(Store(str(tmp_path / "last.ckpt")), Store(str(tmp_path / "copy")))
    assert_same(lightning_like_checkpoint(step=2), io.load_checkpoint(str(tmp_path / "copy")))


def test_kind_changes_on_local_disk(tmp_path: Path) -> None:
    """A plain file replaces our directory (a save after fit) and back (the next fit)."""
    path = str(tmp_path / "last.ckpt")
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(step=1), path)
    io.teardown()
    io.save_checkpoint(lightning_like_checkpoint(step=2), path)  # outside fit: a plain file
    assert os.path.isfile(path)
    assert_same(lightning_like_checkpoint(step=2), torch.load(path, weights_only=False))
    io.enable_collective_saves(None)  # the next fit
    io.save_checkpoint(lightning_like_checkpoint(step=3), path)
    io.wait()
    assert os.path.isdir(path) and os.listdir(tmp_path) == ["last.ckpt"]  # nothing left beside it
    assert_same(lightning_like_checkpoint(step=3), io.load_checkpoint(path))
    io.teardown()


# ---- 3. the path exists when save_checkpoint returns --------------------------------------
def test_the_path_exists_when_save_returns(tmp_path: Path, memory_url: str) -> None:
    import fsspec

    io = ShardedAsyncCheckpointIO()
    for url in (str(tmp_path / "a.ckpt"), f"{memory_url}/b.ckpt"):
        io.save_checkpoint(lightning_like_checkpoint(width=256), url)
        fs, path = fsspec.core.url_to_fs(url)
        assert fs.exists(path)  # what ModelCheckpoint.file_exists asks, before the commit
    io.wait()
    io.teardown()


def test_save_last_link_on_a_fresh_dirpath(tmp_path: Path) -> None:
    mc = ModelCheckpoint(dirpath=tmp_path, save_last="link", every_n_train_steps=2, save_top_k=-1)
    make_trainer(4, [mc], root=tmp_path).fit(TinyModel(), loader(4))
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=0-step=4.ckpt"
    assert ShardedAsyncCheckpointIO().load_checkpoint(str(last))["global_step"] == 4


# ---- 4. remove_checkpoint removes any entry, and says when it cannot ----------------------
def test_remove_deletes_a_plain_ckpt_file_and_only_the_link(tmp_path: Path) -> None:
    TorchCheckpointIO().save_checkpoint(lightning_like_checkpoint(), tmp_path / "plain.ckpt")
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(step=3), str(tmp_path / "target.ckpt"))
    io.wait()
    os.symlink("target.ckpt", tmp_path / "link.ckpt")
    io.remove_checkpoint(str(tmp_path / "plain.ckpt"))
    io.remove_checkpoint(str(tmp_path / "link.ckpt"))
    io.wait()
    assert sorted(os.listdir(tmp_path)) == ["target.ckpt"]
    assert io.load_checkpoint(str(tmp_path / "target.ckpt"))["global_step"] == 3
    io.remove_checkpoint(str(tmp_path / "target.ckpt"))
    io.wait()
    assert os.listdir(tmp_path) == []
    io.teardown()


def test_top_k_retention_removes_plain_files_left_by_torch_checkpoint_io(tmp_path: Path) -> None:
    # A run with Lightning's plugin, continued with ours: ModelCheckpoint's restored top-k
    # bookkeeping deletes the old plain .ckpt files through our plugin.
    def run(plugin: Any, max_steps: int, ckpt_path: str | None = None) -> ModelCheckpoint:
        mc = ModelCheckpoint(dirpath=tmp_path, monitor="step", mode="max", save_top_k=1, every_n_train_steps=2)
        make_trainer(max_steps, [mc], plugins=[plugin], root=tmp_path).fit(TinyModel(), loader(8), ckpt_path=ckpt_path)
        return mc

    first = run(TorchCheckpointIO(), 2)
    assert os.path.isfile(first.best_model_path)
    run(ShardedAsyncCheckpointIO(), 6, ckpt_path=first.best_model_path)
    # The resumed-from file is kept by Lightning's own rule; the later ones are ours.
    left = sorted(os.listdir(tmp_path))
    assert left == ["epoch=0-step=2.ckpt", "epoch=0-step=6.ckpt"], left


def test_a_failed_remove_is_logged_with_the_path(caplog: pytest.LogCaptureFixture) -> None:
    CrashFileSystem.reset()
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(), "crashfs://rm/a")
    io.wait()
    CrashFileSystem.fail_removes = True
    with caplog.at_level(logging.ERROR, logger="lightning_preempt"):
        io.remove_checkpoint("crashfs://rm/a")
        io.wait()  # the failure is reported, not raised into training
    CrashFileSystem.fail_removes = False
    assert any("could not remove checkpoint crashfs://rm/a" in r.getMessage() for r in caplog.records)
    assert any("HINT:" in r.getMessage() for r in caplog.records)
    io.teardown()


# ---- 5. nothing at the path is a FileNotFoundError --------------------------------------
def test_a_missing_ckpt_path_is_worded_as_lightning_words_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning's own tests (test_try_resume_from_non_existing_checkpoint, test_hpc_restore_attempt)
    # and users' scripts match on TorchCheckpointIO's text: it stays the prefix, our HINT follows.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^Checkpoint file not found: not existing\nHINT: ") as info:
        make_trainer(3, []).fit(TinyModel(), loader(4), ckpt_path="not existing")
    assert isinstance(info.value, CheckpointNotFoundError) and ".ckpt file" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing written while failing


def test_a_missing_ckpt_path_raises_file_not_found_in_fit(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        make_trainer(2, [], root=tmp_path).fit(TinyModel(), loader(4), ckpt_path=str(tmp_path / "missing.ckpt"))
    assert isinstance(info.value, CheckpointNotFoundError)
    assert "missing.ckpt" in str(info.value) and "HINT:" in str(info.value)
    # Something that exists but is not a checkpoint is not "not found".
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError) as info2:
        ShardedAsyncCheckpointIO().load_checkpoint(str(tmp_path / "empty"))
    assert not isinstance(info2.value, FileNotFoundError)


# ---- 7. outside fit: synchronous, no thread left behind --------------------------------
def test_save_after_fit_then_load_from_checkpoint(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    model = TinyModel()
    trainer = make_trainer(3, [], root=tmp_path)
    trainer.fit(model, loader(4))
    assert _our_threads(before) == []  # teardown stopped the writer
    path = str(tmp_path / "final.ckpt")
    trainer.save_checkpoint(path)
    assert _our_threads(before) == []  # synchronous: no thread restarted
    loaded = TinyModel.load_from_checkpoint(path)  # Lightning's own loader, no plugin involved
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    assert trainer.strategy.checkpoint_io.load_checkpoint(path)["global_step"] == 3
    # Saving again replaces it; removing is synchronous too.
    trainer.save_checkpoint(path)
    trainer.strategy.remove_checkpoint(path)
    assert not os.path.exists(path) and _our_threads(before) == []


def test_save_before_fit_then_load_from_checkpoint(tmp_path: Path) -> None:
    """A Trainer that never ran fit: its plugin is never set up nor torn down. The save is
    synchronous (a plain file, there when save_checkpoint returns) and leaves no thread."""
    before = set(threading.enumerate())
    model = TinyModel()
    trainer = make_trainer(3, [], root=tmp_path)
    trainer.strategy.connect(model)
    path = str(tmp_path / "untrained.ckpt")
    trainer.save_checkpoint(path)
    assert os.path.isfile(path) and _our_threads(before) == []
    loaded = TinyModel.load_from_checkpoint(path)  # Lightning's own loader, right after the call
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    trainer.strategy.remove_checkpoint(path)
    assert not os.path.exists(path) and _our_threads(before) == []


def test_storage_options_that_are_not_a_dict_get_a_clear_error(tmp_path: Path) -> None:
    io = ShardedAsyncCheckpointIO()
    with pytest.raises(TypeError, match="storage_options must be a dict") as info:
        io.save_checkpoint({"w": torch.ones(2)}, str(tmp_path / "x"), storage_options="anon")  # type: ignore[arg-type]
    assert "HINT:" in str(info.value) and not (tmp_path / "x").exists()


def test_on_exception_checkpoint_saves_then_its_teardown_removes_synchronously(tmp_path: Path) -> None:
    class Boom(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("boom")

    def on_exception() -> OnExceptionCheckpoint:
        return OnExceptionCheckpoint(dirpath=str(tmp_path), filename="on_exception")

    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer(5, [on_exception(), Boom()], root=tmp_path).fit(TinyModel(), loader(4))
    path = str(tmp_path / "on_exception.ckpt")
    assert ShardedAsyncCheckpointIO().load_checkpoint(path)["global_step"] == 2  # committed by teardown
    probe = StartProbe()
    make_trainer(4, [on_exception(), probe], root=tmp_path).fit(TinyModel(), loader(4), ckpt_path=path)
    assert probe.start_step == 2
    # A normal end: OnExceptionCheckpoint.teardown removed it, after the plugin's teardown.
    assert not os.path.exists(path)
    assert _our_threads(before) == []


# ---- 6. weights_only and map_location reach the loader -------------------------------------
class Recipe:
    """A custom object in the hyperparameters: not something ``weights_only`` loads."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


class RecipeModel(TinyModel):
    def __init__(self, recipe: Recipe | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_fit_passes_weights_only_to_the_plugin(tmp_path: Path) -> None:
    path = str(tmp_path / "a.ckpt")
    mc = ModelCheckpoint(dirpath=tmp_path, filename="a", every_n_train_steps=2, save_top_k=1, monitor=None)
    make_trainer(2, [mc], root=tmp_path).fit(RecipeModel(Recipe(0.1)), loader(4))
    assert os.path.isdir(path)
    with pytest.raises(CheckpointError, match=r"needs the global test_dropin\.Recipe"):
        make_trainer(4, [], root=tmp_path).fit(RecipeModel(Recipe(0.1)), loader(4), ckpt_path=path, weights_only=True)
    probe = StartProbe()
    make_trainer(4, [probe], root=tmp_path).fit(RecipeModel(Recipe(0.1)), loader(4), ckpt_path=path, weights_only=False)
    assert probe.start_step == 2
    meta = ShardedAsyncCheckpointIO().load_checkpoint(path, map_location="meta", weights_only=False)
    assert all(t.device.type == "meta" for t in meta["state_dict"].values())
    assert meta["hyper_parameters"]["recipe"].lr == 0.1
