"""Issue 20, finding 6: two plugin-level saves to one step directory at the same moment
(real separate processes, no lease) never end "committed but corrupt": exactly one is told
"committed" and its checkpoint verifies bit for bit; the other is told another writer
committed first. The 30-trial count is ``benchmarks/bench_concurrent_commit.py``."""

from __future__ import annotations

from pathlib import Path

from concurrent_saves import run_trials


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
    for trial_dir in tmp_path.iterdir():
        names = sorted(p.name for p in (trial_dir / "step-0000000100").iterdir())
        assert "manifest.json" in names and ".lightning_preempt.writer" not in names, names


def test_two_concurrent_replacements_of_one_checkpoint_never_tear_it(tmp_path: Path) -> None:
    """Both save over a committed checkpoint at once: each commit replaces the manifest, and
    neither one's clean-up deletes the other's generation, so what is committed verifies."""
    trials = run_trials(str(tmp_path), [0.0, 0.02], replace=True)
    for trial in trials:
        assert not trial.corrupt, trial
        assert trial.committed_step is not None and trial.winners >= 1, trial
