"""A small sample of ``tests/support/fault_injection.py``: SIGTERM and SIGKILL a real training
job at random moments (steps, a flush in flight, start-up) and check every restart.

The full run (N >= 30 per signal) and its results: ``docs/fault-injection.md``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "fault_injection.py"
EVERY = 5

# ~30 s here (4 trials, ~6 launches): in the rotating slow sample to keep README's test command
# under its 8-minute budget (tests/support/fault_injection.py itself is the full matrix).
pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_fault_injection_sample(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    args = [sys.executable, str(SCRIPT), "--n", "2", "--seed", "0", "--kinds", "sigterm,sigkill"]
    args += ["--every", str(EVERY), "--width", "65536", "--md", "", "--json", str(out)]
    args += ["--workdir", str(tmp_path / "work")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=850, check=False)
    log = (done.stdout + done.stderr)[-6000:]
    assert out.exists(), log
    summary = json.loads(out.read_text())
    trials = summary["trials"]
    assert len(trials) == 4, log
    verdicts = {v["name"]: v for v in summary["verdicts"]}
    assert verdicts["resumed_newest"]["met"], log
    assert verdicts["sigterm_lost"]["met"], log
    assert verdicts["sigkill_lost"]["met"], log
    assert verdicts["no_problems"]["met"], log
    for t in trials:
        assert t["resumed_newest"] and t["lost"] is not None, t
        assert t["exit_code"] == (143 if t["kind"] == "sigterm" else -9), t
        if t["kind"] == "sigterm":
            assert t["lost"] == 0, t
        else:  # the bound the sigkill_lost verdict uses: a kill during a flush loses that save too
            assert t["lost"] <= (2 * EVERY if t["hit"] == "flush" else EVERY), t
    assert done.returncode == 0, log
