"""Lightning's subprocess launcher SIGKILLs every process once a child exits non-zero; after a
preemption a child's exit with exit_code gives the others grace to exit by themselves
(lightning/_compat/trainer.py tolerate_preempted_children). The observer is Lightning's own; the
"main process" it kills is a stand-in subprocess here, not the test."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from lightning_preempt.lightning._compat import tolerate_preempted_children


def _proc(sleep_s: float, code: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({sleep_s}); sys.exit({code})"])


def _observe(child_code: int, main_s: float, *, tolerant: bool, wait_s: float = 3.0) -> int:
    """The stand-in main process's return code: -9 when the observer killed it."""
    main, child = _proc(main_s, 143), _proc(0.3, child_code)
    observer = _ChildProcessObserver(main_pid=main.pid, child_processes=[child], sleep_period=0.1)  # type: ignore[arg-type]
    observer.start()
    if tolerant:
        assert tolerate_preempted_children(143, wait_s) == 1
        assert tolerate_preempted_children(143, wait_s) == 0  # once per observer
    try:
        return main.wait(timeout=30)
    finally:
        # a real main process's exit ends the daemon thread with it; here: stop it
        observer._run = lambda: True  # type: ignore[method-assign]
        observer.join(timeout=10)
        for p in (main, child):
            p.kill()
            p.wait()


def test_lightning_kills_the_main_process_when_a_child_exits_preempted() -> None:
    assert _observe(143, 1.5, tolerant=False) == -9  # what users got: rank 0 killed mid-exit


def test_a_preempted_child_leaves_the_main_process_time_to_exit_by_itself() -> None:
    assert _observe(143, 1.5, tolerant=True) == 143


@pytest.mark.parametrize(("child_code", "main_s"), [(1, 5.0), (143, 8.0)])
def test_a_failed_child_or_a_main_process_past_the_wait_is_still_killed(child_code: int, main_s: float) -> None:
    began = time.monotonic()
    assert _observe(child_code, main_s, tolerant=True, wait_s=1.0) == -9
    assert time.monotonic() - began < main_s
