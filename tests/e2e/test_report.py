"""``lightning-preempt report`` against what a test observed: a real training job preempted
three times (two SIGTERMs, one SIGKILL) and run to the end, on local disk and on ``gs://``
(the GCS emulator). The report's JSON must say 3 preemptions, 3 restarts, 0 steps lost for
the SIGTERMs and exactly the steps since the last commit for the SIGKILL, the time down
the test waited, and a goodput inside what the measured times allow; ``--plot`` writes a PNG.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from ckpts import committed
from jobs import launch, step_of, wait_for

from lightning_preempt.cli import main

if TYPE_CHECKING:
    from objectstore_plugin import Remote

pytest_plugins = ["objectstore_plugin"]
pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(300)]

STEPS, EVERY, SLEEP = 40, 5, 0.03
GAP_S = 0.5  # the "queue time" between an exit and the next start, that the report must find


def _observe_three_preemptions(tmp: Path, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Run the job 4 times (SIGTERM, SIGTERM, SIGKILL, to the end); what the test saw."""
    status = tmp / "st"
    common = ["--dirpath", url, "--status", str(status), "--max-steps", str(STEPS), "--every", str(EVERY),
              "--step-sleep", str(SLEEP), "--ledger-progress-s", "0", "--storage-options", json.dumps(options)]  # fmt: skip
    seen: dict[str, Any] = {"launched": [], "exited": [], "agreed": [], "resumed": [0]}

    def run(*extra: str, sigterm_after: int | None = None) -> int:
        for f in status.glob("*.step"):
            f.unlink()
        seen["launched"].append(time.time())
        proc = launch("train_script.py", tmp, *common, *extra)
        if sigterm_after is not None:
            wait_for(proc, f"step {sigterm_after}", lambda: (step_of(status) or 0) >= sigterm_after)
            os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
        seen["exited"].append(time.time())
        steps = committed(url, options)
        seen["resumed"].append(steps[0] if steps else 0)  # the newest committed step: where the next resumes
        time.sleep(GAP_S)  # the job waits in the queue: time down, measured by the report
        assert proc.returncode in (143, -signal.SIGKILL, 0), out[-3000:]
        return int(proc.returncode)

    assert run(sigterm_after=8) == 143
    seen["agreed"].append(seen["resumed"][-1])  # the snapshot is the newest checkpoint
    assert run(sigterm_after=seen["resumed"][-1] + 6) == 143
    seen["agreed"].append(seen["resumed"][-1])
    kill_at = seen["resumed"][-1] + 8 + (1 if (seen["resumed"][-1] + 8) % EVERY == 0 else 0)  # not at a save
    assert run("--signal-at", f"ledger-kill:{kill_at}") == -signal.SIGKILL
    seen["killed_at"] = kill_at
    assert run() == 0
    seen["resumed"].pop()  # after the last (finished) run nobody resumes
    return seen


def _report(url: str, options: dict[str, Any], capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    opts = [f"-o{k}={json.dumps(v)}" for k, v in options.items()]
    assert main(["report", url, "--json", *opts, *args]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def _check(report: dict[str, Any], seen: dict[str, Any]) -> None:
    assert report["source"] == "ledger" and report["finished"] and report["last_step"] == STEPS
    assert report["processes"] == 4 and report["restarts"] == 3
    pre = report["preemptions"]
    assert [p["kind"] for p in pre] == ["signal", "signal", "killed"]
    assert [p["source"] for p in pre[:2]] == ["SIGTERM", "SIGTERM"] and all(p["committed"] for p in pre[:2])
    assert [p["step"] for p in pre] == [*seen["agreed"], seen["killed_at"]]
    assert [p["resumed_step"] for p in pre] == seen["resumed"][1:]
    lost_kill = seen["killed_at"] - seen["resumed"][3]  # the steps since the last commit
    assert lost_kill > 0
    assert [p["steps_lost"] for p in pre] == [0, 0, lost_kill] and report["steps_lost"] == lost_kill
    assert all(0 < p["to_exit_s"] < 30 for p in pre[:2])
    observed_wall = seen["exited"][-1] - seen["launched"][0]
    alive = sum(e - s for s, e in zip(seen["launched"], seen["exited"]))
    assert 0 < report["wall_s"] <= observed_wall
    assert 3 * GAP_S <= report["down_s"] <= observed_wall - report["training_s"]
    # useful time: at least the STEPS steps that count (each sleeps SLEEP), at most the processes' lives
    assert STEPS * SLEEP <= report["useful_s"] <= alive
    assert report["goodput"] == pytest.approx(report["useful_s"] / (report["wall_s"] - report["first_start_s"]))
    assert report["wall_s"] == pytest.approx(report["first_start_s"] + report["training_s"] + report["down_s"])
    assert report["steps_trained"] == STEPS + lost_kill  # the SIGKILL's steps were trained twice
    assert report["saves"] >= STEPS // EVERY and report["checkpoint_blocking_s"] > 0
    assert report["plan"] is not None and report["plan"]["recommended_s"] > 0
    assert report["plan"]["in_use_steps"] == EVERY


def test_report_of_a_run_preempted_three_times_on_local_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "ck")
    seen = _observe_three_preemptions(tmp_path, url, {})
    png = tmp_path / "timeline.png"
    report = _report(url, {}, capsys, "--plot", str(png), "--gpu-hour-price", "2", "--on-demand-price", "6")
    _check(report, seen)
    cost = report["cost"]
    assert cost["cost"] == pytest.approx(report["wall_s"] / 3600 * 2)
    assert cost["saved"] == pytest.approx(cost["on_demand_cost"] - cost["cost"])
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.shape[0] >= 400 and image.shape[1] >= 800 and image.std() > 0.05  # drawn, not blank


def test_report_of_a_run_preempted_three_times_on_gcs(
    tmp_path: Path, gs_remote: Remote, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _observe_three_preemptions(tmp_path, gs_remote.url, gs_remote.storage_options)
    _check(_report(gs_remote.url, gs_remote.storage_options, capsys), seen)
