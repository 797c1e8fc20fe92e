"""Real `trainer.fit` runs: auto-resume, fallback, ModelCheckpoint, LightningCLI."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from ckpts import committed, flip_byte
from jobs import launch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyModel, data, loader
from torch.utils.data import DataLoader
from trainers import StartProbe, fit, make_trainer

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning, list_checkpoints
from lightning_preempt.format.names import checkpoint_name

ROOT = Path(__file__).resolve().parents[2]


def test_resume_restores_the_exact_step_weights_and_optimizer(tmp_path: Path) -> None:
    first = fit(tmp_path, max_steps=10, every=10)
    assert first.probe.start_step == 0
    weights_at_10 = {k: v.clone() for k, v in first.model.state_dict().items()}
    # A new process would build the model from a different seed: resume must overwrite it.
    probe2 = fit(tmp_path, max_steps=20, every=10, seed=123).probe
    assert probe2.start_step == 10
    for k, v in weights_at_10.items():
        assert torch.equal(probe2.start_weights[k], v), k
    assert probe2.start_optim["state"][0]["step"].item() == 10
    assert committed(tmp_path) == [20, 10]


def test_resume_ends_where_lightnings_own_resume_ends(tmp_path: Path) -> None:
    fit(tmp_path / "ours", max_steps=10, every=10)
    ours = fit(tmp_path / "ours", max_steps=25, every=10, seed=7).model

    L.seed_everything(0)
    mc = ModelCheckpoint(dirpath=tmp_path / "plain", every_n_train_steps=10, save_top_k=-1)
    make_trainer(10, [mc], plugins=[]).fit(TinyModel(), loader())
    L.seed_everything(7)
    theirs = TinyModel()
    make_trainer(25, [], plugins=[]).fit(theirs, loader(), ckpt_path=str(tmp_path / "plain" / "epoch=0-step=10.ckpt"))
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), k


def test_an_explicit_ckpt_path_wins_over_auto_resume(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=20, every=10)
    first_run = {c.manifest.run_id for c in list_checkpoints(str(tmp_path)) if c.manifest}
    L.seed_everything(0)
    probe = StartProbe()
    cb = PreemptionCallback(str(tmp_path), every_n_train_steps=10)
    make_trainer(25, [cb, probe]).fit(TinyModel(), loader(), ckpt_path=str(tmp_path / checkpoint_name(10)))
    assert probe.start_step == 10
    # the lease's second look at dirpath is for auto-resume only: it chose nothing here
    assert cb.engine.run_id not in first_run
    # Step 20 re-reached (dirpath held it at set-up): saved beside the first run's, which stays.
    twenties = [c for c in list_checkpoints(str(tmp_path)) if c.step == 20 and c.committed and c.manifest]
    assert sorted(c.manifest.run_id in first_run for c in twenties) == [False, True], twenties
    assert (tmp_path / checkpoint_name(20)).is_dir() and twenties[0].name != twenties[1].name


def test_a_save_of_a_new_step_leaves_the_storage_alone_while_training_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path of a step above what dirpath held at set-up is fresh without asking the storage
    (a bucket's round trips at every save), and the write job creates it: the training thread's
    saves call nothing of the storage (the flag: inside our on_train_batch_end)."""
    import threading

    from lightning_preempt.storage.store import Store

    asked: list[str] = []
    inside = threading.Event()
    # every method of Store that reaches the storage (path, url_of, child and parent only compute names)
    for name in ("entries", "stat", "info", "open_read", "read_bytes", "makedirs", "open_write", "commit_bytes", "rm_file"):
        original = getattr(Store, name)

        def spy(self: Store, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            if inside.is_set() and threading.current_thread() is threading.main_thread():
                asked.append(f"{_name} {self.url}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Store, name, spy)
    hook = PreemptionCallback.on_train_batch_end

    def watched(self: PreemptionCallback, *args: Any) -> None:
        inside.set()
        try:
            hook(self, *args)
        finally:
            inside.clear()

    monkeypatch.setattr(PreemptionCallback, "on_train_batch_end", watched)
    fit(tmp_path, max_steps=5, every=2, keep_last_n=10)
    first = len(asked)
    resumed = fit(tmp_path, max_steps=9, every=2, keep_last_n=10)
    assert resumed.probe.start_step == 5
    assert asked == [], [*asked[:first], "(second run)", *asked[first:]]
    assert committed(tmp_path) == [9, 8, 6, 5, 4, 2]


def test_a_corrupt_newest_checkpoint_is_skipped_in_fit(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=20, every=10)
    flip_byte(next((tmp_path / checkpoint_name(20)).glob("*.distcp")))
    assert fit(tmp_path, max_steps=25, every=100).probe.start_step == 10


def test_retention_and_the_final_save(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=11, every=3, keep_last_n=2)
    assert [(c.step, c.committed) for c in list_checkpoints(str(tmp_path))] == [(11, True), (9, True)]


def test_no_resume_when_disabled(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=10, every=10)
    assert fit(tmp_path / "other", max_steps=5, resume=False).probe.start_step == 0


def test_model_checkpoint_top1_keeps_exactly_the_best(tmp_path: Path) -> None:
    L.seed_everything(0)
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", monitor="val_loss", mode="min", save_top_k=1)
    model = TinyModel()
    run = make_trainer(40, [mc], val_check_interval=5, limit_val_batches=2, num_sanity_val_steps=0)
    run.fit(model, loader(), DataLoader(data(32, seed=1), batch_size=16))
    run.strategy.checkpoint_io.teardown()
    kept = sorted(p.name for p in (tmp_path / "mc").iterdir())
    assert kept == [Path(mc.best_model_path).name]
    best = list_checkpoints(str(tmp_path / "mc"))
    assert len(best) == 1 and best[0].committed
    loaded = ShardedAsyncCheckpointIO().load_checkpoint(mc.best_model_path)
    # ModelCheckpoint's own state went through the plugin, with the best score it kept.
    mc_state = next(v for k, v in loaded["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert mc_state["best_model_path"] == mc.best_model_path


def test_the_callback_installs_the_plugin_when_none_is_configured(tmp_path: Path) -> None:
    L.seed_everything(0)
    run = make_trainer(4, [PreemptionCallback(str(tmp_path), every_n_train_steps=2)], plugins=[])
    run.fit(TinyModel(), loader())
    assert isinstance(run.strategy.checkpoint_io, ShardedAsyncCheckpointIO)
    assert committed(tmp_path) == [4, 2]


def test_bad_arguments_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="HINT"):
        PreemptionCallback("ck", every_n_train_steps=0)
    with pytest.raises(ValueError, match="HINT"):
        PreemptionCallback("ck", keep_last_n=0)
    with pytest.raises(ValueError, match="HINT"):
        PreemptionCallback("ck", tuning=Tuning(signals=("SIGNOPE",)))
    with pytest.raises(ValueError, match="HINT"):
        PreemptionCallback("")


def test_lightning_cli_yaml_sets_both_up_and_resumes(tmp_path: Path) -> None:
    config = (ROOT / "examples" / "config.yaml").read_text()
    config = config.replace("dirpath: checkpoints/cli-demo", f"dirpath: {tmp_path / 'ck'}")
    (tmp_path / "config.yaml").write_text(config)
    cli = ROOT / "examples" / "train_cli.py"
    args = ["fit", "--config", str(tmp_path / "config.yaml")]
    workdir = tmp_path / "run"  # LightningCLI saves the effective config here, not over ours
    workdir.mkdir()
    first = launch(cli, workdir, *args, "--trainer.max_steps", "40")
    out, _ = first.communicate(timeout=240)
    assert first.returncode == 0, out[-3000:]
    second = launch(cli, workdir, *args)
    out, _ = second.communicate(timeout=240)
    assert second.returncode == 0, out[-3000:]
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", out)
    assert resumed and int(resumed.group(1)) == 40
    assert committed(tmp_path / "ck") == [60, 40]
    # the effective config went under checkpoints/ (git ignores it), nothing beside the code
    assert sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*")) == ["checkpoints", "checkpoints/config.yaml"]


def test_saves_and_resumes_are_reported_through_the_loggers(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    def run(max_steps: int, **kw: Any) -> Path:
        L.seed_everything(0)
        logger = CSVLogger(str(tmp_path / "logs"), name="run", version=f"{max_steps}{sorted(kw)}")
        cb = PreemptionCallback(str(tmp_path / "ck"), every_n_train_steps=4, **kw)
        make_trainer(max_steps, [cb], logger=logger, log_every_n_steps=1).fit(TinyModel(), loader())
        return Path(logger.log_dir) / "metrics.csv"

    first = run(8).read_text()
    header = first.splitlines()[0].split(",")
    assert {"checkpoint/blocking_s", "checkpoint/commit_s", "checkpoint/bytes", "checkpoint/throughput_MBps"} <= set(
        header
    )
    rows = [dict(zip(header, line.split(","), strict=True)) for line in first.splitlines()[1:]]
    saved = [r for r in rows if r["checkpoint/bytes"]]
    assert [int(r["step"]) for r in saved] == [4, 8]
    assert all(float(r["checkpoint/bytes"]) > 0 and float(r["checkpoint/commit_s"]) > 0 for r in saved)
    # the run's figures from the goodput ledger, on the same rows (rank 0, at the save steps)
    assert all(float(r["preempt/preemptions"]) == 0 and float(r["preempt/restarts"]) == 0 for r in saved)
    assert all(float(r["preempt/steps_lost"]) == 0 and 0 < float(r["preempt/goodput"]) <= 1 for r in saved)
    second = run(12).read_text()
    header = second.splitlines()[0].split(",")
    assert "preempt/resumed_from_step" in header
    rows = [dict(zip(header, line.split(","), strict=True)) for line in second.splitlines()[1:]]
    assert [float(r["preempt/restarts"]) for r in rows if r["checkpoint/bytes"]] == [1.0]  # the save at 12
    off = run(16, tuning=Tuning(log_metrics=False))  # turned off: nothing of ours in the user's logger
    assert not off.exists() or ("checkpoint/" not in off.read_text() and "preempt/" not in off.read_text())
