"""After a preemption, leave at once: CPython's teardown (1-5 s) is grace the next job lacks.

Everything registered still runs as :class:`~lightning_preempt.Preempted` unwinds;
:func:`armed` arms only when that exception leaves the outermost frame (``sys.settrace``),
then its ``atexit`` handler runs the others, flushes the logs and every open buffered file
object (``open_files.py``: what CPython's teardown would have flushed; within 2 s) and
``os._exit(exit_code)``. It stands aside when the program catches ``Preempted``, under
another tracer, and off the main thread.
"""

from __future__ import annotations

import atexit
import contextlib
import dis
import os
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from lightning_preempt.preemption.open_files import Flusher

_E = TypeVar("_E", bound=BaseException)
# the armed exit code, the log flush, the thread that flushes the open files
_state: dict[str, Any] = {"code": None, "flush": None, "files": None}
_RETURNS = frozenset({"RETURN_VALUE", "RETURN_CONST"})


def armed(exception: _E, code: int, flush: Callable[[], None]) -> _E:
    """``exception`` (for the caller to raise), with the quick exit armed: if it leaves the
    program's outermost frame unhandled, the process exits with ``code`` right after the
    ``atexit`` handlers (``flush`` flushes the logs first)."""
    if threading.current_thread() is not threading.main_thread() or sys.gettrace() is not None:
        return exception
    try:
        alive = weakref.ref(exception)  # no strong reference: a caught and dropped one is freed
    except TypeError:  # a built-in exception class (Preempted, a subclass, has weak references)
        return exception
    outer = sys._getframe()
    while outer.f_back is not None:
        outer = outer.f_back

    def stop() -> None:
        if sys.gettrace() is untraced:
            sys.settrace(None)
        outer.f_trace = None

    def untraced(frame: FrameType, event: str, arg: Any) -> None:
        if alive() is None:  # caught and dropped: the program goes on, untraced
            stop()
        return None  # frames called from now on are not traced

    def watch(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "exception":  # raised into this frame (a bare re-raise makes no event)
            _state["code"] = code if arg[1] is alive() else None
        elif event == "return":
            stop()
            # Left by an exception (a call, a raise, a finally's re-raise), not a return: the
            # last exception raised into it is still the one on its way out.
            by_exception = dis.opname[frame.f_code.co_code[frame.f_lasti]] not in _RETURNS
            if _state["code"] is not None and by_exception:
                with contextlib.suppress(RuntimeError):  # no thread: the logs are still flushed
                    _state["files"] = Flusher()  # now: not from atexit (Python 3.12 refuses it there)
                atexit.register(_exit_now)
        return watch

    outer.f_trace = watch
    outer.f_trace_lines = False
    _state.update(code=None, flush=flush, files=None)
    sys.settrace(untraced)
    return exception


def _exit_now() -> None:
    code = _state["code"]
    if code is None:
        return
    atexit.unregister(_exit_now)
    atexit._run_exitfuncs()  # every handler registered before this one, as the exit would run them
    _state["flush"]()
    if _state["files"] is not None:  # a user's unclosed file keeps its buffered lines
        _state["files"].flush()
    os._exit(code)
