"""An unannounced node loss in the ledger (a ``failure`` record the heartbeats' survivors
wrote) shows in ``lightning-preempt report``: kind, steps lost, the tier the resume came from."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_preempt.catalog.goodput import summarize
from lightning_preempt.catalog.ledger_reader import read_ledger
from lightning_preempt.cli.app import main
from lightning_preempt.collective.heartbeat import Verdict
from lightning_preempt.engine.failures import write_failure_record
from lightning_preempt.format import ledger_records as fmt
from lightning_preempt.format.names import ledger_record_name

RUN = "a" * 32


def _start(restart: int, t: float, resumed: int, tier: str | None) -> dict[str, object]:
    return fmt.make("start", run=RUN, restart=restart, seq=0, t=t, resumed_step=resumed,
                    resumed_from=None if tier is None else f"/ck/step-{resumed:010d}", process_start_t=t - 5,
                    startup_s=5.0, world_size=2, every_n_train_steps=5, every_n_seconds=None, grace_period_s=30.0,
                    host="h", pid=1, resumed_tier=tier)  # fmt: skip


def _write(root: Path, records: list[dict[str, object]]) -> None:
    d = root / ".lp-ledger" / RUN
    d.mkdir(parents=True, exist_ok=True)
    for r in records:
        (d / ledger_record_name(int(r["restart"]), int(r["seq"]), str(r["kind"]))).write_bytes(fmt.encode(r))  # type: ignore[call-overload]


def _verdict(rank: int = 0) -> Verdict:
    return Verdict(rank=rank, world=2, survivors=(rank,), lost=(1 - rank,), agreed_step=10, quorum=rank == 0,
                   agreed=True, silent_s=4.2, detected_t=0.0, decided_t=4.2)  # fmt: skip


def test_failure_record_is_create_only_and_reported(tmp_path: Path, capsys: object) -> None:
    _write(tmp_path, [_start(0, 1000.0, 0, None), fmt.make("progress", run=RUN, restart=0, seq=1, t=1010.0, step=12)])
    assert write_failure_record(str(tmp_path), {}, RUN, _verdict(0), step=13, restart=None)
    # the other side of a partition comes second: it records nothing
    assert not write_failure_record(str(tmp_path), {}, RUN, _verdict(1), step=13, restart=None)
    _write(
        tmp_path, [_start(1, 1030.0, 10, "dirpath"), fmt.make("finish", run=RUN, restart=1, seq=1, t=1040.0, step=30)]
    )
    read = read_ledger(str(tmp_path))
    assert not read.notes, read.notes
    summary = summarize(read.runs[RUN].records)
    [loss] = summary["preemptions"]
    assert loss["kind"] == "node lost" and loss["step"] == 13 and loss["resumed_step"] == 10
    assert loss["steps_lost"] == 3 and loss["steps_lost_at_least"] is False
    assert loss["resumed_tier"] == "dirpath" and loss["agreed_step"] == 10 and loss["to_exit_s"] == 4.2
    assert summary["segments"][0]["end"] == "lost"
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "rank(s) 1 silent 4.2s (heartbeats)" in out and "10 (dirpath)" in out
    assert main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["preemptions"][0]["kind"] == "node lost"  # type: ignore[attr-defined]


def test_old_start_records_without_the_tier_still_read(tmp_path: Path) -> None:
    old = _start(0, 1000.0, 0, None)
    del old["resumed_tier"]
    fmt.check(old)  # an older version's record: the optional field is absent
    bad = {**old, "resumed_tier": 3}
    try:
        fmt.check(bad)
    except fmt.LedgerRecordError:
        pass
    else:
        raise AssertionError("a resumed_tier of the wrong type was accepted")
