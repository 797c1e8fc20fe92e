"""The quick exit (preemption/quick_exit.py) is taken exactly when the armed exception ends
the program: small real interpreters (no torch), each marking what ran on its way out.

``module teardown`` is written by a module global's ``__del__``, which only CPython's
interpreter teardown runs: present = the ordinary exit, absent = the quick one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_preempt.preemption import quick_exit

PRELUDE = """
import atexit, os, sys
from lightning_preempt.preemption.quick_exit import armed
MARKS = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def mark(what): os.write(MARKS, (what + "\\n").encode())
class Teardown:
    def __init__(self): self.write, self.fd = os.write, MARKS
    def __del__(self): self.write(self.fd, b"module teardown\\n")
TEARDOWN = Teardown()
atexit.register(mark, "atexit")
class Stop(SystemExit): pass
def preempt(): raise armed(Stop(143), 143, lambda: mark("flushed"))
"""

CASES = {
    # the program's last act: quick exit, after atexit and the flush
    "unhandled": ("preempt()", 143, ["atexit", "flushed"]),
    "through a finally": ("try:\n    preempt()\nfinally:\n    mark('finally')", 143, ["finally", "atexit", "flushed"]),
    "re-raised by an except": ("try:\n    preempt()\nexcept Stop:\n    mark('except')\n    raise", 143, ["except", "atexit", "flushed"]),
    # the program goes on or ends another way: the ordinary exit
    "caught, the program goes on": ("try:\n    preempt()\nexcept Stop:\n    mark('caught')\nmark('went on')", 0, ["caught", "went on", "atexit", "module teardown"]),
    "caught, then sys.exit(3)": ("try:\n    preempt()\nexcept Stop:\n    sys.exit(3)", 3, ["atexit", "module teardown"]),
    "another error in a finally": ("try:\n    preempt()\nfinally:\n    raise ValueError('other')", 1, ["atexit", "module teardown"]),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_quick_exit_is_taken_only_when_the_exception_ends_the_program(tmp_path: Path, case: str) -> None:
    body, code, marks = CASES[case]
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(PRELUDE) + body + "\n")
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "marks")], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert out.returncode == code, out.stderr
    assert (tmp_path / "marks").read_text().splitlines() == marks


def test_a_caught_and_dropped_exception_leaves_nothing_traced() -> None:
    class Stop(SystemExit):
        pass

    before = sys.gettrace()
    try:
        raise quick_exit.armed(Stop(143), 143, lambda: None)
    except Stop:
        pass
    (lambda: None)()  # the first call after the exception is freed removes the trace function
    assert sys.gettrace() is before
    assert quick_exit._state["code"] is None
