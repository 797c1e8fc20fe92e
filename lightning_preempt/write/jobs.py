"""The job queue: one background thread that runs save and delete jobs in order.

Why its exit drain is a ``multiprocessing`` finalizer: docs/design.md "Threads and process groups".
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing import util as mp_util
from typing import Any

log = logging.getLogger(__name__)

#: Runs before multiprocessing's own exit work (joining children) and before finalizers
#: without a priority; the drain needs the process group, which is still alive then.
EXIT_PRIORITY = 50


class JobQueue:
    """A single worker thread with a FIFO of jobs, each returning a :class:`Future`."""

    def __init__(self, name: str = "lightning_preempt-writer") -> None:
        self._name = name
        self._queue: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last: Future[Any] | None = None
        self._exit_hook: mp_util.Finalize | None = None
        self._exit_hook_pid = 0

    def __reduce__(self) -> tuple[type[JobQueue], tuple[str]]:
        # Threads, locks, queues and futures cannot be pickled, and a copy must not share
        # them: a copy is an idle writer with the same name.
        return JobQueue, (self._name,)

    @property
    def running(self) -> bool:
        """Whether the worker thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # A daemon thread plus an exit drain (docs/design.md): every way out
                # waits for pending commits, yet an idle writer never keeps a process alive.
                self._thread = _Worker(self)
                self._thread.start()
                if self._exit_hook is None or self._exit_hook_pid != os.getpid():
                    self._exit_hook = mp_util.Finalize(None, self._close_at_exit, args=(os.getpid(),),
                                                       exitpriority=EXIT_PRIORITY)  # fmt: skip
                    self._exit_hook_pid = os.getpid()
            self._queue.put((job, fut))
            self._last = fut
        return fut

    def drain(self) -> None:
        """Block until every job submitted so far has finished (errors stay in their Futures)."""
        last = self._last
        if last is not None:
            with contextlib.suppress(Exception):
                last.exception()

    def close(self) -> None:
        """Finish every queued job, then stop the thread (a later ``submit`` starts a new one)."""
        self.drain()
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._queue.put(None)
                self._thread.join()
            self._thread = None
            self._last = None
            if self._exit_hook is not None and self._exit_hook_pid == os.getpid():
                self._exit_hook.cancel()
            self._exit_hook = None

    def _close_at_exit(self, pid: int) -> None:
        # A child made by a bare os.fork inherits this hook but not the thread: nothing to wait for.
        if os.getpid() == pid:
            self.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(job())
            except BaseException as err:
                fut.set_exception(err)
            # Not held while waiting for the next job: a save job's closure holds its staged
            # tensors, and the stager frees a buffer it replaces only if nobody else holds it.
            item = job = fut = None  # type: ignore[assignment]


class _Worker(threading.Thread):
    """The queue's daemon thread; ``stop()`` (:meth:`JobQueue.close`) is what tools that reap
    daemon threads call (Lightning's test suite does after every test, failing one without it)."""

    def __init__(self, jobs: JobQueue) -> None:
        super().__init__(target=jobs._run, name=jobs._name, daemon=True)
        self.stop = jobs.close
