"""The goodput ledger and ``lightning-preempt report`` without training: the ledger's writer
thread on real files (compaction, a storage it cannot write), records that are damaged,
oversized, foreign or hostile (skipped with a note, text escaped), and the report's figures
and text from a ledger whose times the test chose."""

from __future__ import annotations

import json
import logging
import time
import types
from pathlib import Path
from typing import Any

import pytest

from lightning_preempt.catalog.goodput import summarize
from lightning_preempt.catalog.ledger_reader import read_ledger
from lightning_preempt.cli import main
from lightning_preempt.engine import ledger_writer as writer
from lightning_preempt.format import ledger_records as fmt
from lightning_preempt.format.names import LEDGER_DIR, ledger_record_name

RUN = "0123456789abcdef0123456789abcdef"
T0 = 1_800_000_000.0


def _record(kind: str, restart: int, seq: int, t: float, **fields: Any) -> dict[str, Any]:
    return fmt.make(kind, run=RUN, restart=restart, seq=seq, t=T0 + t, **fields)


def _start(restart: int, t: float, resumed: int, boot: float = 2.0) -> dict[str, Any]:
    return _record("start", restart, 0, t, resumed_step=resumed, resumed_from=None, process_start_t=T0 + t - boot,
                   startup_s=boot, world_size=2, every_n_train_steps=10, every_n_seconds=None, grace_period_s=30.0,
                   host="node", pid=7)  # fmt: skip


def _save(restart: int, seq: int, t: float, step: int, kind: str = "periodic") -> dict[str, Any]:
    return _record("save", restart, seq, t, save_kind=kind, step=step, blocking_s=0.5, committed_s=2.0,
                   bytes=10**9, tier="dirpath", error=None)  # fmt: skip


def _scripted_run(source: str = "SIGTERM") -> list[dict[str, Any]]:
    """Three processes, 1 step a second: a SIGTERM at step 25 (snapshot), 60 s down; a SIGKILL
    at step 47 (last commit 40), 100 s down; then to step 60."""
    return [
        _start(0, 10, 0), _save(0, 1, 22, 10), _save(0, 2, 32, 20),
        _save(0, 3, 37, 25, "emergency"),
        _record("preemption", 0, 4, 38, source=source, received_t=T0 + 35, step=25, snapshot_step=25,
                committed=True, to_exit_s=3.0, steps_lost=0, agreed_after_steps=2, agreed_after_s=0.31),
        _start(1, 100, 25), _save(1, 1, 117, 40), _record("progress", 1, 2, 122, step=47),
        _start(2, 224, 40), _save(2, 1, 246, 60, "final"), _record("finish", 2, 2, 246, step=60),
    ]  # fmt: skip


def _write(root: Path, records: list[dict[str, Any]]) -> Path:
    run = root / LEDGER_DIR / RUN
    run.mkdir(parents=True, exist_ok=True)
    for r in records:
        (run / ledger_record_name(r["restart"], r["seq"], r["kind"])).write_bytes(fmt.encode(r))
    return run


def test_the_summary_counts_what_the_script_did() -> None:
    s = summarize(_scripted_run())
    assert s["processes"] == 3 and s["restarts"] == 2 and s["finished"] and s["last_step"] == 60
    assert [(p["kind"], p["step"], p["resumed_step"], p["steps_lost"]) for p in s["preemptions"]] == [
        ("signal", 25, 25, 0), ("killed", 47, 40, 7)]  # fmt: skip
    assert s["wall_s"] == pytest.approx(246 - 8)  # first process start (2 s of start-up) to the finish
    assert s["training_s"] == pytest.approx((38 - 10) + (122 - 100) + (246 - 224))
    assert s["down_s"] == pytest.approx((100 - 38) + (224 - 122))  # each end to the next first step
    assert s["steps_trained"] == 25 + 22 + 20 and s["steps_lost"] == 7
    step_s = s["training_s"] / s["steps_trained"]
    assert s["useful_s"] == pytest.approx(s["training_s"] - 5 * 0.5 - 7 * step_s)
    assert s["goodput"] == pytest.approx(s["useful_s"] / (s["wall_s"] - 2.0))  # after the first start


def test_report_text_json_and_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, _scripted_run())
    args = ["report", str(tmp_path), "--gpu-hour-price", "2", "--on-demand-price", "5"]
    assert main(args) == 0
    text = capsys.readouterr().out
    for expected in ("3 process(es), 2 restart(s), step 60, finished", "goodput", "SIGTERM", "no record (SIGKILL",
                     "`plan` recommends", "(10 steps)", "on demand at 5"):  # fmt: skip
        assert expected in text, text
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["cost"]["gpus"] == 2 and r["cost"]["cost"] == pytest.approx(r["wall_s"] / 3600 * 2 * 2)
    assert r["plan"]["in_use_steps"] == 10 and r["plan"]["mtbf_s"] == pytest.approx(r["wall_s"] / 2)
    # the plot (matplotlib) is drawn and opened as an image by tests/e2e/test_demo.py and test_report.py


def test_damaged_oversized_foreign_and_hostile_records_are_skipped_or_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write(tmp_path, _scripted_run(source="SIG\x1b]0;owned\x07\nTERM"))
    (run / "r00003-000000-start.json").write_bytes(b'{"format": "lightning_preempt.ledger/1", "kind": "st')
    (run / "r00003-000001-save.json").write_bytes(b" " * (fmt.MAX_RECORD_BYTES + 1))
    (run / "r00003-000002-finish.json").write_text(json.dumps({**_record("finish", 3, 2, 300, step=1), "format": "x"}))
    (run / "r00003-000003-finish.json").write_bytes(fmt.encode(_record("finish", 3, 9, 300, step=1)))  # seq mismatch
    nan = json.dumps(_record("finish", 3, 4, 300, step=1)).replace(str(T0 + 300), "NaN")
    (run / "r00003-000004-finish.json").write_text(nan)
    (run / "notes.txt").write_text("hello")
    (tmp_path / LEDGER_DIR / "not a run!").mkdir()
    read = read_ledger(str(tmp_path))
    assert list(read.runs) == [RUN] and len(read.runs[RUN].records) == len(_scripted_run())
    joined = "\n".join(read.notes)
    for why in ("r00003-000000-start.json: not JSON", "r00003-000001-save.json: larger than", "format is not",
                "does not match its name", "r00003-000004-finish.json: not JSON", "1 file(s) that are not ledger"):
        assert why in joined, joined  # fmt: skip
    assert main(["report", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out and "\x07" not in out and "SIG\\x1b]0;owned\\x07\\nTERM" in out
    assert "skipped r00003-000001-save.json" in err
    assert main(["report", str(tmp_path), "--run", "../../etc"]) == 1  # a run id is a path component
    assert "is not a run id" in capsys.readouterr().err


def test_the_writer_compacts_and_a_ledger_it_cannot_write_only_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(writer, "COMPACT_EVERY", 8)
    monkeypatch.setattr(fmt, "COMPACT_KEEPS_SAVES", 3)
    clock = iter(range(1_000_000))  # the records 1 s apart: goodput tells the blocking counted
    # the writer's clock only (not the process's: logging and the store keep the real one)
    fake = types.SimpleNamespace(time=lambda: T0 + next(clock), monotonic=time.monotonic)
    monkeypatch.setattr(writer, "time", fake)
    config = type("C", (), {"every_n_train_steps": 1, "every_n_seconds": None, "grace_period_s": 30.0})()
    ledger = writer.Ledger(str(tmp_path), {}, RUN)
    ledger.add("start", **writer.start_fields(0, None, 1, config))
    for step in range(1, 21):
        ledger.add("save", save_kind="periodic", step=step, blocking_s=0.5, committed_s=0.6, bytes=100,
                   tier="dirpath", error=None)  # fmt: skip
    assert ledger.flush(10)
    # The figures logged during training count the saves compaction folded away too.
    on_disk = read_ledger(str(tmp_path)).runs[RUN]
    running = summarize(on_disk.records, on_disk.folded_saves, running=True)
    assert running["saves"] == 20 and running["checkpoint_blocking_s"] == pytest.approx(20 * 0.5)
    assert ledger.figures()["preempt/goodput"] == pytest.approx(running["goodput"])
    ledger.add("finish", step=20)
    ledger.close()
    names = sorted(p.name for p in (tmp_path / LEDGER_DIR / RUN).iterdir())
    assert len(names) <= 8 and sum(n.startswith("r00000-c") for n in names) == 1, names
    read = read_ledger(str(tmp_path))
    summary = summarize(read.runs[RUN].records, read.runs[RUN].folded_saves)
    assert summary["saves"] == 20 and summary["finished"] and summary["last_step"] == 20
    assert summary["checkpoint_blocking_s"] == pytest.approx(20 * 0.5)
    again = writer.Ledger(str(tmp_path), {}, RUN)  # the next process of the run: restart 1
    again.add("finish", step=20)
    again.close()
    assert again.restart == 1 and (tmp_path / LEDGER_DIR / RUN / "r00001-000000-finish.json").exists()

    (tmp_path / "file").write_text("not a directory")
    caplog.set_level(logging.WARNING, logger="lightning_preempt")
    broken = writer.Ledger(str(tmp_path / "file" / "ck"), {}, RUN)
    for step in range(3):
        broken.add("progress", step=step)
    broken.close()
    warned = [r.getMessage() for r in caplog.records if "goodput ledger failed" in r.getMessage()]
    assert len(warned) == 1 and "HINT:" in warned[0] and "training goes on" in warned[0]


def test_the_report_names_the_exit_column_for_what_it_measures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``to_exit_s`` ends at the exit decision, not at the process's end (issue 32): the column
    and the down row say so, and the figure shown is the record's."""
    _write(tmp_path, _scripted_run())
    assert main(["report", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "STEPS LOST" in line)
    assert "TO EXIT CALL" in header and "DOWN" in header, text
    assert "TO EXIT CALL: from the signal to the decision to exit" in text and "teardown" in text, text
    row = next(line for line in text.splitlines() if "SIGTERM" in line and "committed" in line)
    assert row.split()[-3] == "3s" and row.endswith("1m 2s"), row  # to_exit_s=3.0 as it is; then DOWN
    assert "(teardown, queue, then" in text, text


def test_the_report_shows_how_long_the_ranks_took_to_agree_on_the_first_signal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 58: the preemption record carries the signal-to-agreed latency; a record written
    before it (no such fields) and a kill (no record) show ``-``."""
    records = _scripted_run()
    older = _record("preemption", 2, 3, 247, source="SIGTERM", received_t=T0 + 246, step=60, snapshot_step=60,
                    committed=True, to_exit_s=1.0, steps_lost=0)  # fmt: skip
    _write(tmp_path, [*records[:-1], older])
    assert main(["report", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "AGREED AFTER" in text and "from the first signal (on any rank)" in text, text
    rows = [line for line in text.splitlines() if line.lstrip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3, text
    assert "2 steps, 310ms" in rows[0], rows[0]
    assert rows[1].split("crash)")[1].split()[:3] == ["47", "-", "-"], text  # killed: no record
    assert rows[2].split()[3:5] == ["60", "-"], text  # a record written before the field
    assert main(["report", str(tmp_path), "--json"]) == 0
    pre = json.loads(capsys.readouterr().out)["preemptions"]
    assert [(p["agreed_after_steps"], p["agreed_after_s"]) for p in pre] == [(2, 0.31), (None, None), (None, None)]


def test_the_writer_compacts_by_bytes_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records with long text reach the byte bound before the count one (issue 32): a compacted
    file appears and the single files stay few; the summary still counts every save."""
    monkeypatch.setattr(writer, "COMPACT_EVERY", 10_000)  # the count alone would never compact here
    monkeypatch.setattr(writer, "COMPACT_EVERY_BYTES", 4000, raising=False)
    monkeypatch.setattr(fmt, "COMPACT_KEEPS_SAVES", 3)
    config = type("C", (), {"every_n_train_steps": 1, "every_n_seconds": None, "grace_period_s": 30.0})()
    ledger = writer.Ledger(str(tmp_path), {}, RUN)
    ledger.add("start", **writer.start_fields(0, None, 1, config))
    for step in range(1, 41):  # failed saves with a 400-character error line: ~700 bytes a record
        ledger.add("save", save_kind="periodic", step=step, blocking_s=0.01, committed_s=None, bytes=100,
                   tier="dirpath", error="E" * 400)  # fmt: skip
    ledger.add("finish", step=40)
    ledger.close()
    names = sorted(p.name for p in (tmp_path / LEDGER_DIR / RUN).iterdir())
    singles = [n for n in names if not n.startswith("r00000-c")]
    assert sum(n.startswith("r00000-c") for n in names) == 1 and len(singles) <= 8, names
    assert sum((tmp_path / LEDGER_DIR / RUN / n).stat().st_size for n in singles) < 4000 + 1000, names
    read = read_ledger(str(tmp_path))
    summary = summarize(read.runs[RUN].records, read.runs[RUN].folded_saves)
    assert summary["saves"] == 40 and summary["finished"] and summary["last_step"] == 40
