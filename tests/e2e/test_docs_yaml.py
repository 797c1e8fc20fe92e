"""The LightningCLI YAML the docs show (README's "Use it", docs/notices.md) is run through
``LightningCLI`` with examples/train_cli.py's model and data (the ``[cli]`` extra:
``jsonargparse[signatures]``): every snippet builds a Trainer with our callback and plugin
set up as written, and README's trains, commits a checkpoint and resumes from it.
examples/config.yaml itself is run by tests/e2e/test_trainer.py."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from lightning.pytorch import Callback

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning, list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
_YAML = re.compile(r"^```yaml\n(.*?)^```", re.M | re.S)


def _snippets() -> list[tuple[str, str]]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _YAML.findall(page.read_text()):
            if "class_path: lightning_preempt." in block:
                found.append((page.relative_to(ROOT).as_posix(), block))
    return found


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_cli_example", ROOT / "examples" / "train_cli.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli(config: Path, *args: str) -> Any:
    from lightning.pytorch.cli import LightningCLI

    example = _example()
    return LightningCLI(
        example.RegressionModel,
        example.SyntheticData,
        args=["--config", str(config), "--trainer.accelerator", "cpu", "--trainer.logger", "false", *args],
        run=False,
        save_config_callback=None,
    )


def test_the_docs_show_lightningcli_yaml() -> None:
    pages = {page for page, _ in _snippets()}
    assert {"README.md", "docs/notices.md"} <= pages


@pytest.mark.parametrize("page,block", _snippets(), ids=lambda v: v if v.endswith(".md") else "")
def test_each_yaml_snippet_builds_the_trainer_it_describes(
    page: str, block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the snippets' relative dirpaths land here
    (tmp_path / "config.yaml").write_text(block)
    cli = _cli(tmp_path / "config.yaml")
    written = yaml.safe_load(block)["trainer"]
    (ours,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, PreemptionCallback)]
    wanted = next(c for c in written["callbacks"] if c["class_path"] == "lightning_preempt.PreemptionCallback")
    # the same options as the Python call with the snippet's init_args (the config is validated there)
    init_args = dict(wanted["init_args"])
    if "tuning" in init_args:  # a mapping of Tuning's fields: LightningCLI makes the Tuning
        init_args["tuning"] = Tuning(**init_args["tuning"])
        assert ours.config.tuning == init_args["tuning"], page
    assert ours.config == PreemptionCallback(**init_args).config, page
    assert ours.config.dirpath == wanted["init_args"]["dirpath"]
    if any(p.get("class_path") == "lightning_preempt.ShardedAsyncCheckpointIO" for p in written.get("plugins", [])):
        assert isinstance(cli.trainer.strategy.checkpoint_io, ShardedAsyncCheckpointIO)


def test_the_readme_yaml_trains_commits_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ((_, block),) = [(page, b) for page, b in _snippets() if page == "README.md"]
    (tmp_path / "config.yaml").write_text(block)
    dirpath = yaml.safe_load(block)["trainer"]["callbacks"][0]["init_args"]["dirpath"]
    cli = _cli(tmp_path / "config.yaml", "--trainer.max_steps", "6", "--trainer.enable_progress_bar", "false")
    cli.trainer.fit(cli.model, cli.datamodule)
    assert [c.step for c in list_checkpoints(str(tmp_path / dirpath)) if c.committed] == [6]  # the end-of-fit save
    again = _cli(tmp_path / "config.yaml", "--trainer.max_steps", "9", "--trainer.enable_progress_bar", "false")
    steps: list[int] = []

    class Steps(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            steps.append(trainer.global_step)

    again.trainer.callbacks.append(Steps())
    again.trainer.fit(again.model, again.datamodule)
    assert steps == [7, 8, 9]  # resumed from the checkpoint at 6, trained only the rest
    assert [c.step for c in list_checkpoints(str(tmp_path / dirpath)) if c.committed] == [9, 6]


def test_a_0_2_yaml_still_builds_the_same_trainer_with_a_future_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old names under ``init_args`` keep working for one release (engine/deprecated.py)."""
    monkeypatch.chdir(tmp_path)
    head = "trainer:\n  callbacks:\n    - class_path: lightning_preempt.PreemptionCallback\n      init_args:\n"
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(head + "        dirpath: ck\n        signals: [SIGUSR1, SIGTERM]\n        list_retries: 3\n"
                   "  plugins:\n    - class_path: lightning_preempt.ShardedAsyncCheckpointIO\n"
                   "      init_args: {thread_count: 2}\n")  # fmt: skip
    new.write_text(head + "        dirpath: ck\n        tuning: {signals: [SIGUSR1, SIGTERM], retries: 3}\n"
                   "  plugins:\n    - class_path: lightning_preempt.ShardedAsyncCheckpointIO\n"
                   "      init_args: {tuning: {thread_count: 2}}\n")  # fmt: skip
    with pytest.warns(FutureWarning) as caught:
        before = _cli(old)
    assert {"PreemptionCallback(list_retries=...) is deprecated; use PreemptionCallback(tuning=Tuning(retries=...))",
            "ShardedAsyncCheckpointIO(thread_count=...) is deprecated; use ShardedAsyncCheckpointIO(tuning=Tuning("
            "thread_count=...))"} <= {str(w.message).removeprefix("lightning_preempt: ") for w in caught}  # fmt: skip
    after = _cli(new)
    ours = [next(cb for cb in cli.trainer.callbacks if isinstance(cb, PreemptionCallback)) for cli in (before, after)]
    assert ours[0].config == ours[1].config and ours[0].config.retries == 3
    plugins = [cli.trainer.strategy.checkpoint_io for cli in (before, after)]
    assert plugins[0].config == plugins[1].config and plugins[0].config.thread_count == 2
