"""How a preempted process leaves, in real processes (issue 32).

* Preempted: every hook the user registered runs (a callback's on_exception, the
  logger's finalize, a ``finally``, ``atexit``), then the process exits with 143
  without CPython's interpreter teardown (the 1-5 s after the commit): the ``__del__`` of
  a module global, which only that teardown runs, does not run.
* A script that catches ``Preempted`` and goes on gets the ordinary exit (its own code,
  the interpreter's teardown included).
* A user's file object left open keeps the lines in its buffer through the quick exit
  (issue 55): the exit flushes what the interpreter's teardown would have.
* A SIGTERM after ``trainer.fit`` returned ends the process with 143 and no traceback
  (it was killed by the signal: -15, which SLURM records as FAILED).

Fresh interpreters, not the zygote of support/jobs.py: the zygote catches ``SystemExit``
around the script, which makes the program go on (the ordinary exit).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import SUPPORT

pytestmark = pytest.mark.multiproc
HOOKS = ["callback on_exception Preempted", "logger finalize failed", "finally", "atexit"]


def _start(tmp: Path, mode: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(SUPPORT / "exit_script.py"), "--dirpath", str(tmp / "ck"), "--marks", str(tmp / "marks"), "--mode", mode]  # fmt: skip
    return subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _marks(tmp: Path) -> list[str]:
    return (tmp / "marks").read_text().splitlines()


def test_preempted_process_runs_every_user_hook_then_leaves_without_interpreter_teardown(tmp_path: Path) -> None:
    proc = _start(tmp_path, "preempt")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "exiting with code 143; safe to resume from: step 6" in out
    marks = _marks(tmp_path)
    assert marks == HOOKS, marks  # in the order Lightning and Python run them; no "module teardown"


def test_a_caught_preemption_gets_the_ordinary_exit(tmp_path: Path) -> None:
    proc = _start(tmp_path, "catch")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    marks = _marks(tmp_path)
    assert marks[:3] == HOOKS[:3], marks
    assert marks[3:] == ["caught 143", "went on", "atexit", "module teardown"], marks


@pytest.mark.parametrize("mode", ["preempt", "after-fit"])
def test_a_users_unclosed_file_keeps_its_buffered_lines_through_the_quick_exit(tmp_path: Path, mode: str) -> None:
    proc = _start(tmp_path, mode)
    if mode == "after-fit":
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("FIT-RETURNED"):
                break
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    assert "module teardown" not in _marks(tmp_path)  # it was the quick exit, not the interpreter's
    assert (tmp_path / "user.log").read_text().splitlines() == [f"user line {i}" for i in range(8)]


def test_sigterm_after_fit_exits_with_143_and_no_traceback(tmp_path: Path) -> None:
    proc = _start(tmp_path, "after-fit")
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("FIT-RETURNED"):
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 143, (proc.returncode, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    assert "SIGTERM after training ended; exiting with code 143; safe to resume from: step 8" in out, out[-3000:]
    assert _marks(tmp_path) == ["logger finalize success", "finally", "atexit"]  # not "slept to the end"
