"""The README's demo (examples/preemption_demo.py) runs, finds the weights identical and ends with
`lightning-preempt report` of its preempted run and the timeline PNG."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")


@pytest.mark.multiproc
def test_demo_quick_reports_identical_weights_and_writes_the_plots(tmp_path: Path) -> None:
    out = tmp_path / "demo_out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "examples/preemption_demo.py", "--quick", "--sigkill", "1", "--seed", "5", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    report = proc.stdout
    assert proc.returncode == 0, report[-3000:] + proc.stderr[-3000:]
    assert "Final weights: IDENTICAL to the uninterrupted run" in report
    assert "Preemptions: 2  (1 SIGTERM, 1 SIGKILL)" in report
    png = out / "progress.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    # the demo ends with `lightning-preempt report` of its preempted run: 2 preemptions, its timeline
    assert "$ lightning-preempt report" in report and "3 process(es), 2 restart(s), step 40, finished" in report
    assert "goodput" in report and "SIGTERM" in report and "no record (SIGKILL or crash)" in report
    # one "down" (issue 56): the demo's column and the report's DOWN are the same span per preemption
    demo_down = [float(m) for m in re.findall(r"^ *\d+  SIG(?:TERM|KILL) .* ([\d.]+) s$", report, re.M)]
    table = report[report.index("TO EXIT CALL") :]
    report_down = [_seconds(line.split()[-1]) for line in table.splitlines() if re.match(r"^\d+ +\d+ ", line)]
    assert len(demo_down) == len(report_down) == 2, report
    assert all(abs(a - b) < 1.0 for a, b in zip(demo_down, report_down)), (demo_down, report_down)
    import matplotlib.image

    image = matplotlib.image.imread(str(out / "timeline.png"))  # opened as an image: its size, not blank
    assert image.shape[0] >= 400 and image.shape[1] >= 800 and image.std() > 0.05


def _seconds(text: str) -> float:
    """``format_duration``'s ``74.1ms`` / ``4.77s`` as seconds (the quick demo is down seconds, not minutes)."""
    number, unit = re.fullmatch(r"([\d.]+)(ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(number) * {"ms": 1e-3, "s": 1.0, "m": 60.0}[unit]
