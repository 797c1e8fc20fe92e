"""Two tiers: each drain (the upload of a local checkpoint to ``dirpath``) is a ``drain``
record in the goodput ledger, and ``lightning-preempt report`` shows the uploads (issue 32).
A real ``trainer.fit`` with a local tier and a local-disk ``dirpath``."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainers import fit

from lightning_preempt.catalog.goodput import summarize
from lightning_preempt.catalog.ledger_reader import read_ledger
from lightning_preempt.cli import main


def test_the_drains_of_a_two_tier_fit_are_in_the_ledger_and_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote, local = tmp_path / "remote", tmp_path / "local"
    done = fit(str(remote), 6, seed=0, every=3, keep_last_n=2, local_dirpath=local)
    assert done.io.tiers is not None
    uploaded = [(d.step, d.bytes) for d in done.io.tiers.drains if d.skipped is None and d.error is None]
    # Step 3's drain is skipped when step 6 is queued before it starts (a loaded machine):
    # then the ledger and the report must say one upload, not two.
    superseded = [d.step for d in done.io.tiers.drains if d.skipped == "superseded"]
    assert [s for s, _ in uploaded] in ([3, 6], [6]) and superseded == ([] if len(uploaded) == 2 else [3]), (
        done.io.tiers.drains
    )
    (run,) = read_ledger(str(remote)).runs.values()
    drains = [r for r in run.records if r["kind"] == "drain"]
    assert [(r["step"], r["bytes"]) for r in drains if r["drained_s"] is not None] == uploaded, drains
    summary = summarize(run.records, run.folded_saves)["drains"]
    assert summary["uploaded"] == len(uploaded) and summary["newest_step"] == 6
    assert summary["bytes"] == sum(b for _, b in uploaded)
    assert main(["report", str(remote)]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if "uploads (two tiers)" in x)
    assert line.split()[3] == str(len(uploaded)) and "newest step 6" in line and "0 failed" in line, text
