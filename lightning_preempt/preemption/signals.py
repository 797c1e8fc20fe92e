"""Signal handlers that only set a flag: no I/O, locks or collectives in a handler.

Ranks agree on the flag at a step boundary. Handlers chain to the one installed before and
are restored afterwards; one that outlives its owner behaves like the one it replaced.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from lightning_preempt.preemption.sources import Notice

log = logging.getLogger(__name__)

_Handler = Any  # signal handler: callable, SIG_DFL, SIG_IGN or None


def resolve_signal(sig: str | int | signal.Signals) -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"``, ``15`` → ``signal.SIGTERM`` (with a clear error otherwise)."""
    if isinstance(sig, signal.Signals):
        return sig
    if isinstance(sig, int):
        return signal.Signals(sig)
    name = sig.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {sig!r}\nHINT: use names such as 'SIGTERM', 'SIGUSR1' or 'SIGINT'.") from None


class SignalFlag:
    """Records the first of ``signals`` to arrive; :meth:`install` / :meth:`restore` manage handlers."""

    def __init__(self, signals: Sequence[str | int | signal.Signals]) -> None:
        self.signums: tuple[signal.Signals, ...] = tuple(resolve_signal(s) for s in signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None  # time.monotonic()
        self.count = 0
        self.active = False
        self._chain: dict[int, _Handler] = {}

    @property
    def is_set(self) -> bool:
        return self.received is not None

    # ---- PreemptionSource (lightning_preempt.sources) ---------------------------------
    @property
    def name(self) -> str:
        return "signal"

    def start(self) -> None:
        self.install()

    def stop(self) -> None:
        self.restore()

    def poll(self) -> Notice | None:
        """The first signal received, as a :class:`~lightning_preempt.sources.Notice`."""
        if self.received is None or self.received_at is None:
            return None
        return Notice(source=self.received.name, reason=f"received {self.received.name}", received_at=self.received_at)

    def install(self) -> bool:
        """(Re-)install our handlers; returns ``False`` off the main thread (Python's rule)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("lightning_preempt: not on the main thread; signal handlers not installed")
            return False
        for signum in self.signums:
            current = signal.getsignal(signum)
            if current == self._handle:
                continue
            # The first handler we replace is the one to chain to and to restore later.
            self._chain.setdefault(signum, current)
            signal.signal(signum, self._handle)
        self.active = True
        return True

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._chain.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def clear(self) -> None:
        self.received = None
        self.received_at = None
        self.count = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._chain.get(signum, signal.SIG_DFL)
        if not self.active:
            # Stale: behave exactly like the handler we replaced.
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            elif previous in (signal.SIG_DFL, None):
                os.kill(os.getpid(), signum)
            return
        self.count += 1
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()
        if callable(previous):
            previous(signum, frame)
