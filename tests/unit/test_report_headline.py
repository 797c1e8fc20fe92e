"""Issue 56: the report's headline figures mean what a reader expects. A demo run that lost 0
steps read "goodput 20%" (start-ups of every process counted against it) and "expected time
lost 69.2%" (a model's what-if, printed as if measured); its "down" was one span in the demo's
table and another in the report. Now wall time = first start + training + down, "down" is each
process's end to the next one's first step in the summary, the table and the row, goodput is
over the wall time after the first start, and the model's figure is labelled a what-if."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from lightning_preempt.catalog.goodput import summarize
from lightning_preempt.cli import main
from lightning_preempt.format import ledger_records as fmt
from lightning_preempt.format.names import LEDGER_DIR, ledger_record_name

RUN = "fedcba9876543210fedcba9876543210"
T0 = 1_800_000_000.0
BOOT = 3.0  # every process: 3 s from its start to its first step (imports, resume)


def _record(kind: str, restart: int, seq: int, t: float, **fields: Any) -> dict[str, Any]:
    return fmt.make(kind, run=RUN, restart=restart, seq=seq, t=T0 + t, **fields)


def _start(restart: int, t: float, resumed: int) -> dict[str, Any]:
    return _record("start", restart, 0, t, resumed_step=resumed, resumed_from=None, process_start_t=T0 + t - BOOT,
                   startup_s=BOOT, world_size=1, every_n_train_steps=10, every_n_seconds=None, grace_period_s=30.0,
                   host="node", pid=7)  # fmt: skip


def _snapshot_run() -> list[dict[str, Any]]:
    """The demo's shape: 2 s of training per process, 1 step each 0.1 s, two SIGTERMs whose
    snapshots committed (0 steps lost), 1 s from each exit to the next process's start."""
    out: list[dict[str, Any]] = []
    t, step = 3.0, 0
    for restart in range(3):
        out.append(_start(restart, t, step))
        t, step = t + 2.0, step + 20
        out.append(_record("save", restart, 1, t - 0.5, save_kind="periodic", step=step - 5, blocking_s=0.01,
                           committed_s=0.1, bytes=10**6, tier="dirpath", error=None))  # fmt: skip
        if restart < 2:
            out.append(_record("preemption", restart, 2, t, source="SIGTERM", received_t=T0 + t - 0.05, step=step,
                               snapshot_step=step, committed=True, to_exit_s=0.05, steps_lost=0))  # fmt: skip
            t += 1.0 + BOOT  # down: 1 s to the next start, then its start-up
        else:
            out.append(_record("finish", restart, 2, t, step=step))
    return out


def test_wall_time_is_first_start_training_and_down_and_goodput_is_over_what_follows_the_first_start() -> None:
    s = summarize(_snapshot_run())
    assert s["steps_lost"] == 0 and s["restarts"] == 2
    assert s["first_start_s"] == pytest.approx(BOOT) and s["training_s"] == pytest.approx(3 * 2.0)
    assert [p["down_s"] for p in s["preemptions"]] == pytest.approx([1.0 + BOOT] * 2)
    assert s["down_s"] == pytest.approx(sum(p["down_s"] for p in s["preemptions"]))
    assert s["wall_s"] == pytest.approx(s["first_start_s"] + s["training_s"] + s["down_s"])
    # 0 steps lost: goodput is the training kept over the 6 s trained and the 8 s down, not over
    # the first start too (35.1% before: 5.97 / 17)
    assert s["goodput"] == pytest.approx((6.0 - 3 * 0.01) / (6.0 + 8.0))


def test_the_text_shows_one_down_and_says_what_goodput_and_the_what_if_are_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / LEDGER_DIR / RUN
    run.mkdir(parents=True)
    for r in _snapshot_run():
        (run / ledger_record_name(r["restart"], r["seq"], r["kind"])).write_bytes(fmt.encode(r))
    assert main(["report", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    down_row = next(line for line in text.splitlines() if line.strip().startswith("down "))
    assert down_row.split()[1] == "8s", down_row  # the total: 4 s after each of the 2 preemptions
    table = [line for line in text.splitlines() if re.match(r"\s*\d+\s+\d+\s+SIGTERM", line)]
    assert [line.split()[-1] for line in table] == ["4s", "4s"], text  # the same figure per preemption
    goodput = next(line for line in text.splitlines() if line.strip().startswith("goodput"))
    assert "42.6%" in goodput and "/ (wall time - first start)" in goodput, goodput
    assert "what if every preemption were a hard kill" in text and "(this run lost 0 step(s))" in text, text
