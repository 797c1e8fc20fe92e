"""Old runs' goodput ledgers follow retention (issue 32): once none of a run's checkpoints is
left, retention deletes its ledger; the current run's and a run with a checkpoint left stay."""

from __future__ import annotations

from pathlib import Path

from ckpts import lightning_like_checkpoint

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.catalog.ledger_reader import read_ledger
from lightning_preempt.catalog.retention import apply_retention
from lightning_preempt.format import ledger_records as fmt
from lightning_preempt.format.names import LEDGER_DIR, checkpoint_name, ledger_record_name


def _save(root: Path, run: str, steps: list[int]) -> None:
    io = ShardedAsyncCheckpointIO()
    io.saver.run_id = run
    for step in steps:
        io.save_checkpoint(lightning_like_checkpoint(step=step, width=8), str(root / checkpoint_name(step)))
    io.teardown()


def _ledger(root: Path, run: str) -> None:
    folder = root / LEDGER_DIR / run
    folder.mkdir(parents=True)
    record = fmt.make("finish", run=run, restart=0, seq=0, t=1_800_000_000.0, step=1)
    (folder / ledger_record_name(0, 0, "finish")).write_bytes(fmt.encode(record))


def test_a_run_whose_checkpoints_are_all_gone_loses_its_ledger_at_the_next_retention(tmp_path: Path) -> None:
    _save(tmp_path, "runC", [1])  # another run with a checkpoint still there: its ledger stays
    _save(tmp_path, "runB", [5, 6, 7])  # the current run
    for run in ("runA", "runB", "runC"):  # runA: none of its checkpoints is left
        _ledger(tmp_path, run)
    removed = apply_retention(str(tmp_path), keep_last_n=1, run_id="runB")
    assert sorted(Path(p).name for p in removed) == [checkpoint_name(5), checkpoint_name(6)], removed
    assert sorted(read_ledger(str(tmp_path)).runs) == ["runB", "runC"]
    assert not (tmp_path / LEDGER_DIR / "runA").exists()
    # without a run id (an operator's call) no ledger is touched
    _ledger(tmp_path, "runA")
    apply_retention(str(tmp_path), keep_last_n=1)
    assert sorted(read_ledger(str(tmp_path)).runs) == ["runA", "runB", "runC"]
