"""Issue 20, finding 6: two plugin-level saves to one step directory at the same moment
(real separate processes, no lease) never end "committed but corrupt": exactly one is told
"committed" and its checkpoint verifies bit for bit; the other is told another writer
committed first. More trials: ``tests/support/concurrent_saves.py``'s ``run_trials``."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from concurrent_saves import run_trials

from lightning_preempt.errors import CheckpointExistsError
from lightning_preempt.format.manifest import data_store
from lightning_preempt.format.names import CLAIM_NAME, MANIFEST_NAME
from lightning_preempt.read.load import load_all_tensors
from lightning_preempt.read.verify import verify_checkpoint
from lightning_preempt.storage.store import Store
from lightning_preempt.write import commit
from lightning_preempt.write.commit import SaveRequest, write_checkpoint


def test_two_concurrent_saves_to_one_step_dir_leave_the_winner_intact(tmp_path: Path) -> None:
    trials = run_trials(str(tmp_path), [0.0, 0.02])
    for trial in trials:
        assert not trial.corrupt, trial
        assert trial.committed_step is not None, trial  # the path holds a checkpoint that verifies
        # One winner and a loser told so; or, if the second write began after the first
        # commit, a plain replacement (both committed, the second at the path).
        assert (trial.winners, trial.losers_told) in ((1, 1), (2, 0)), trial
        if trial.winners == 1:
            loser = trial.messages[trial.told.index("failed")]
            assert "\nHINT:" in loser, loser
    assert any(t.losers_told for t in trials), "no trial overlapped: nothing was tested"
    # The loser deleted what it wrote: only the winner's files (and no claim) remain.
    for trial_dir in tmp_path.glob("trial-*"):
        names = sorted(p.name for p in (trial_dir / "step-0000000100").iterdir())
        assert "manifest.json" in names and ".lightning_preempt.writer" not in names, names


@pytest.mark.slow  # ~15 s of process start-up; the races are also forced one by one below
def test_two_concurrent_replacements_of_one_checkpoint_never_tear_it(tmp_path: Path) -> None:
    """Both save over a committed checkpoint at once: each commit replaces the manifest, and
    neither one's clean-up deletes the other's generation, so what is committed verifies."""
    trials = run_trials(str(tmp_path), [0.0, 0.02], replace=True)
    for trial in trials:
        assert not trial.corrupt, trial
        assert trial.committed_step is not None and trial.winners >= 1, trial


# ---- the same races, each interleaving forced at one storage operation (one process) ----
class _Interleaving(Store):
    """The real Store; ``before[(thread, name)]`` / ``after[(thread, name)]`` run once around
    the first commit of ``name`` by the thread of that name."""

    before: ClassVar[dict[tuple[str, str], Callable[[], None]]] = {}
    after: ClassVar[dict[tuple[str, str], Callable[[], None]]] = {}

    def commit_bytes(self, rel: str, data: bytes, *, exclusive: bool = True, durable: bool = True) -> None:
        me = threading.current_thread().name
        hook = _Interleaving.before.pop((me, rel), None)
        if hook is not None:
            hook()
        super().commit_bytes(rel, data, exclusive=exclusive, durable=durable)
        hook = _Interleaving.after.pop((me, rel), None)
        if hook is not None:
            hook()


def _request(url: str, step: int) -> SaveRequest:
    tensors = {f"state_dict/w{i}": torch.full((1024,), float(10 * step + i)) for i in range(3)}
    return SaveRequest(url=url, tensors=tensors, skeleton=b"skeleton %d" % step, step=step, epoch=0)


def _committed(url: str) -> tuple[int, dict[str, torch.Tensor]]:
    store = Store(url)
    manifest = verify_checkpoint(store)  # every listed file present with its size and CRC32C
    return manifest.step, load_all_tensors(data_store(store, manifest), manifest=manifest)


def _assert_is(url: str, step: int) -> None:
    committed, tensors = _committed(url)
    expected = _request(url, step).tensors
    assert committed == step and all(torch.equal(tensors[k], v) for k, v in expected.items()), "a mix of two saves"


MAIN = threading.main_thread().name


@pytest.fixture
def interleaving(monkeypatch: pytest.MonkeyPatch) -> type[_Interleaving]:
    monkeypatch.setattr(commit, "Store", _Interleaving)
    _Interleaving.before, _Interleaving.after = {}, {}
    return _Interleaving


def test_a_save_that_finds_the_path_claimed_loses_cleanly_or_wins(
    tmp_path: Path, interleaving: type[_Interleaving]
) -> None:
    """A claims the path and writes in place; B, starting meanwhile, writes its own generation
    and commits first. A is told it lost; B's checkpoint verifies; A's files are gone."""
    url = str(tmp_path / "step-0000000100")
    interleaving.before[(MAIN, MANIFEST_NAME)] = lambda: write_checkpoint(_request(url, 2))  # B, inside A's save
    with pytest.raises(CheckpointExistsError, match="another writer committed") as info:
        write_checkpoint(_request(url, 1))
    assert "\nHINT:" in str(info.value)
    _assert_is(url, 2)
    live = verify_checkpoint(Store(url)).extra["data_dir"]
    assert sorted(os.listdir(url)) == sorted([MANIFEST_NAME, live])  # A's in-place files and the claim went


def test_a_claim_won_after_another_save_committed_replaces_its_checkpoint(
    tmp_path: Path, interleaving: type[_Interleaving]
) -> None:
    """B saw no manifest; before B claims, A saves, commits and releases its claim. B's claim
    then succeeds, and B must replace A's checkpoint (never write into A's files)."""
    url = str(tmp_path / "step-0000000100")
    interleaving.before[(MAIN, CLAIM_NAME)] = lambda: write_checkpoint(_request(url, 1))  # A, inside B's plan
    write_checkpoint(_request(url, 2))
    _assert_is(url, 2)


def test_the_claimers_clean_up_never_deletes_a_generation_being_written(
    tmp_path: Path, interleaving: type[_Interleaving]
) -> None:
    """A claims the path; before A clears the path's leftovers, B (finding A's claim) has
    written its whole generation; B then commits first. A's clean-up must not have taken
    B's files: B's committed checkpoint verifies, and A is told it lost."""
    url = str(tmp_path / "step-0000000100")
    b_wrote, b_may_commit = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def writer_b() -> None:
        try:
            write_checkpoint(_request(url, 2))
        except BaseException as err:
            errors.append(err)

    b = threading.Thread(target=writer_b, name="B")

    def start_b() -> None:  # after A's claim: B writes all of its files, then waits
        interleaving.before[("B", MANIFEST_NAME)] = lambda: (b_wrote.set(), b_may_commit.wait(60))
        b.start()
        assert b_wrote.wait(60)

    def let_b_commit_first() -> None:
        b_may_commit.set()
        b.join(60)

    interleaving.after[(MAIN, CLAIM_NAME)] = start_b
    interleaving.before[(MAIN, MANIFEST_NAME)] = let_b_commit_first
    with pytest.raises(CheckpointExistsError, match="another writer committed"):
        write_checkpoint(_request(url, 1))
    assert errors == []
    _assert_is(url, 2)
