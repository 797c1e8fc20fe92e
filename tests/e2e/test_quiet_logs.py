"""Lightning's messages that our callback and plugin make untrue are not shown, and only
then (issue 24, finding 5): "your dataloader is not resumable. This can cause unreliable
results" on a resume that exact resume put back at its data position, "`weights_only`
was not set, defaulting to `False`" on every save of ours, and the "last checkpoint"
warnings of the auto-resume route. Real ``Trainer`` fits; what is shown is read from the
warnings and from Lightning's loggers as they reach a user."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from models import TinyModel, data
from torch.utils.data import DataLoader, Sampler
from trainers import StartProbe, make_trainer

from lightning_preempt import PreemptionCallback, Tuning

NOT_RESUMABLE = "your dataloader is not resumable"  # what a user reads
LIGHTNING_TEXT = (  # Lightning 2.6's whole warning, to find filters that would hide it
    "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable."
)
WEIGHTS_ONLY = "`weights_only` was not set"
AUTO_RESUME = (
    "(ckpt_path=None)` was called without a model",
    '(ckpt_path="last") is set, but there is no last checkpoint',
)


@dataclass
class Shown:
    """What one run showed: warning texts and the lines of Lightning's loggers."""

    warnings: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    filters_left: list[str] = field(default_factory=list)  # ours, still in force at the end

    def count(self, text: str) -> int:
        return sum(text in w for w in self.warnings) + sum(text in line for line in self.lines)


@contextlib.contextmanager
def shown() -> Iterator[Shown]:
    """The warnings shown (the filters in force, each shown once per block) and every line
    Lightning logs. No "always" filter: it would hide a filter of ours left in force."""
    out = Shown()
    handler = logging.Handler()
    handler.emit = lambda record: out.lines.append(record.getMessage())  # type: ignore[method-assign]
    lightning_log = logging.getLogger("lightning.pytorch")  # Lightning's own handler sits here
    lightning_log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:  # (it resets the "once" registries)
            yield out
            out.filters_left = [
                f[1].pattern for f in warnings.filters if f[1] is not None and f[1].match(LIGHTNING_TEXT)
            ]
    finally:
        lightning_log.removeHandler(handler)
    out.warnings = [str(w.message) for w in caught]


class EveryOther(Sampler[int]):
    """A sampler of the user's own: exact resume cannot put it back at a position."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter([*range(0, self.n, 2), *range(1, self.n, 2)])

    def __len__(self) -> int:
        return self.n


def shuffled() -> DataLoader:
    """10 batches in an order drawn from the loader's generator (exact resume restores it)."""
    return DataLoader(data(160), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))


def own_sampler() -> DataLoader:
    return DataLoader(data(160), batch_size=16, sampler=EveryOther(160))


def fit(
    dirpath: Path, max_steps: int, loader: DataLoader, *, seed: int = 0, exact: bool = True
) -> tuple[TinyModel, PreemptionCallback, StartProbe, Shown]:
    """One process's ``fit`` with the callback (saving every 2 steps) and the plugin."""
    L.seed_everything(seed)
    model, probe = TinyModel(width=8), StartProbe()
    callback = PreemptionCallback(str(dirpath), every_n_train_steps=2, tuning=Tuning(lease=False))
    callback.exact.enabled = exact
    with shown() as out:
        make_trainer(max_steps, [callback, probe], num_sanity_val_steps=0).fit(model, loader)
    return model, callback, probe, out


def test_an_exact_resume_shows_neither_message_and_names_its_checkpoint(tmp_path: Path) -> None:
    whole, _, _, shown_whole = fit(tmp_path / "whole", 12, shuffled())
    _, _, _, shown_first = fit(tmp_path / "run", 6, shuffled())
    resumed, callback, probe, shown_resumed = fit(tmp_path / "run", 12, shuffled(), seed=1)
    # a mid-epoch resume (6 of 10 batches) that exact resume made exact: the same weights bitwise
    assert probe.start_step == 6 and callback.exact.restored == "mid-epoch"
    for name, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    assert shown_resumed.count(NOT_RESUMABLE) == 0
    assert callback.exact.positions_restored
    # 6 + 3 + 3 saves of ours, none with Lightning's weights_only line
    assert [out.count(WEIGHTS_ONLY) for out in (shown_whole, shown_first, shown_resumed)] == [0, 0, 0]
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-0000000010", "step-0000000012"]
    # Lightning's restore lines name the real checkpoint (the pointer file is ours)
    step6 = tmp_path / "run" / "step-0000000006"
    assert [line for line in shown_resumed.lines if "estor" in line] == [
        f"Restoring states from the checkpoint path at {step6}",
        f"Restored all states from the checkpoint at {step6}",
    ]
    assert shown_resumed.filters_left == []  # nothing stays in force after the resume's first batch


@pytest.mark.parametrize("case", ["own-sampler", "exact-resume-off"])
def test_a_resume_that_is_not_exact_still_shows_lightnings_warning(tmp_path: Path, case: str) -> None:
    loader, exact = (own_sampler, True) if case == "own-sampler" else (shuffled, False)
    fit(tmp_path, 6, loader(), exact=exact)
    _, callback, probe, out = fit(tmp_path, 12, loader(), seed=1, exact=exact)
    assert probe.start_step == 6
    assert out.count(NOT_RESUMABLE) == 1  # true here: the epoch's data starts again from its first batch
    if case == "own-sampler":
        assert out.count("lightning_preempt: cannot resume the position of the training data") == 1
    assert out.count(WEIGHTS_ONLY) == 0  # still our saves: weights_only is ours to decide
    assert not callback.exact.positions_restored and out.filters_left == []


def test_plain_lightning_in_the_same_process_still_shows_both_messages(tmp_path: Path) -> None:
    fit(tmp_path / "ours", 6, shuffled())
    _, callback, _, ours = fit(tmp_path / "ours", 12, shuffled(), seed=1)
    assert ours.count(NOT_RESUMABLE) == 0 and ours.count(WEIGHTS_ONLY) == 0 and callback.exact.positions_restored

    def plain(max_steps: int, **fit_kwargs: Any) -> tuple[L.Trainer, Shown]:
        every6 = ModelCheckpoint(dirpath=tmp_path / "plain", every_n_train_steps=6, save_top_k=-1)
        trainer = make_trainer(max_steps, [every6], plugins=[], num_sanity_val_steps=0)
        with shown() as out:
            trainer.fit(TinyModel(width=8), shuffled(), **fit_kwargs)
        return trainer, out

    _, first = plain(6)
    saved = tmp_path / "plain" / "epoch=0-step=6.ckpt"
    trainer, resumed = plain(12, ckpt_path=str(saved))
    assert torch.load(saved, weights_only=False)["global_step"] == 6 and trainer.global_step == 12
    assert first.count(NOT_RESUMABLE) == 0 and resumed.count(NOT_RESUMABLE) == 1  # true: no exact resume here
    with shown() as out:
        trainer.save_checkpoint(tmp_path / "mine.ckpt")  # the user left weights_only unset: true
    assert out.count(WEIGHTS_ONLY) == 1 and "optimizer_states" in torch.load(tmp_path / "mine.ckpt", weights_only=False)


def test_the_auto_resume_route_is_quiet_only_in_trainers_with_our_callback(tmp_path: Path) -> None:
    _, callback, probe, ours = fit(tmp_path / "ours", 2, shuffled())  # a fresh start: fit() gets no ckpt_path
    assert probe.start_step == 0 and callback.resumed_from is None
    assert (tmp_path / "ours" / "step-0000000002" / "manifest.json").is_file()
    assert [ours.count(text) for text in AUTO_RESUME] == [0, 0]
    # Lightning's own OnExceptionCheckpoint in the same process: its warnings are its words, shown
    trainer = make_trainer(2, [OnExceptionCheckpoint(tmp_path / "plain")], plugins=[], num_sanity_val_steps=0)
    with shown() as plain:
        trainer.fit(TinyModel(width=8), shuffled())
    assert trainer.global_step == 2 and [plain.count(text) for text in AUTO_RESUME] == [1, 1]


@pytest.mark.slow  # two spawned workers: ~15 s on 2 cores
def test_ddp_spawn_workers_do_not_show_the_last_checkpoint_warnings(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """ddp_spawn unpickles the callback in fresh worker processes, where Lightning chooses
    ``fit``'s checkpoint path (rank 0 warns there): the filter is installed there too."""
    callback = PreemptionCallback(str(tmp_path / "ck"), every_n_train_steps=2, tuning=Tuning(lease=False))
    trainer = make_trainer(4, [callback], strategy="ddp_spawn", devices=2, num_sanity_val_steps=0, root=tmp_path)
    trainer.fit(TinyModel(width=8), DataLoader(data(64), batch_size=8))
    out, err = capfd.readouterr()
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-0000000002", "step-0000000004"]
    for text in AUTO_RESUME:
        assert text not in out + err, (out + err)[-3000:]
