"""Flush the program's open buffered files before the quick exit.

``os._exit`` skips CPython's teardown, and with it the finalizer of every file object still
open: a user's ``f = open(...)`` never closed lost the lines still in its buffer. Python keeps
no list of open files, so :func:`flush_open_files` finds them the way the garbage collector
would, in ``gc.get_objects()`` (cost: docs/design.md "What the quick exit flushes"), and
flushes each writable one; the exit waits for that at most :data:`FLUSH_BUDGET_S`.

Only the standard buffered types (``io.TextIOWrapper``, ``io.BufferedWriter``,
``io.BufferedRandom`` and their subclasses) are flushed, and never closed: their ``flush``
is C code that writes the buffer and nothing else. Other writers (a ``gzip.GzipFile``'s
trailer, a user's class) are the program's to close, in a ``finally`` or ``atexit``.
"""

from __future__ import annotations

import contextlib
import gc
import io
import itertools
import threading
from typing import Any

#: The most the exit waits for the search and the flushes (:class:`Flusher`).
FLUSH_BUDGET_S = 2.0

_BASES: tuple[type, ...] = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _kinds() -> frozenset[type]:
    """The buffered file types and every subclass defined so far (an exact ``type`` lookup
    per object of the heap is cheaper than ``isinstance``)."""
    seen: set[type] = set()
    todo = list(_BASES)
    while todo:
        kind = todo.pop()
        if kind not in seen:
            seen.add(kind)
            todo.extend(kind.__subclasses__())
    return frozenset(seen)


def _writable(f: Any) -> bool:
    try:  # a closed or detached file raises ValueError here
        return not f.closed and bool(f.writable())
    except Exception:
        return False


def open_files() -> list[Any]:
    """Every open, writable buffered file object in the heap, text wrappers first (flushing
    one also flushes the binary buffer under it)."""
    kinds = _kinds()
    objects = gc.get_objects()
    found = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    del objects
    found.sort(key=lambda f: not isinstance(f, io.TextIOWrapper))
    return [f for f in found if _writable(f)]


def flush_open_files() -> int:
    """Flush every open, writable buffered file object; the number flushed. Errors (a closed
    pipe, a full disk) are ignored: the process is leaving. Unbounded: see :class:`Flusher`."""
    flushed = 0
    for f in open_files():
        with contextlib.suppress(Exception):
            f.flush()
            flushed += 1
    return flushed


class Flusher:
    """:func:`flush_open_files` on a daemon thread, for the exit to wait at most a budget.

    A flush can block for good: on a full pipe nobody reads, on a hung mount, or on the lock
    of a file whose write another (daemon) thread is stuck in; the lock's wait cannot be
    interrupted, not even by a signal. So the flush runs on its own thread and the exit stops
    waiting after the budget. The thread is started before the interpreter's shutdown
    begins (:func:`~lightning_preempt.preemption.quick_exit.armed`'s trace, as the exception
    leaves the program): Python 3.12 refuses to start one in an ``atexit`` handler.
    """

    def __init__(self) -> None:
        self._go = threading.Event()
        self._done = threading.Event()
        self.flushed = 0
        self.thread = threading.Thread(target=self._run, name="lightning_preempt-flush", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self._go.wait()
        try:
            self.flushed = flush_open_files()
        finally:
            self._done.set()

    def flush(self, budget_s: float = FLUSH_BUDGET_S) -> bool:
        """Flush now; whether every flush finished within ``budget_s``."""
        self._go.set()
        return self._done.wait(budget_s)
