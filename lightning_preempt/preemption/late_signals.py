"""Signals after training ended: an exit with ``exit_code``, not death by the signal.

A SIGTERM after ``trainer.fit`` returned killed the process (-15), which SLURM records as
FAILED. :class:`LateSignals` takes the signals whose handler is still the default: the first
calls ``on_signal``, later ones are noted. :func:`hand_back` restores the default before
training again (one set of handlers per process, so :data:`LATE` is the one instance).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType

log = logging.getLogger(__name__)


class LateSignals:
    """Handlers for ``signums`` that call ``on_signal`` once (main thread only)."""

    def __init__(self, signums: Sequence[signal.Signals], on_signal: Callable[[signal.Signals], None]) -> None:
        self.signums = tuple(signums)
        self.on_signal = on_signal
        self.fired: signal.Signals | None = None
        self.later = 0  # signals after the first one (absorbed)
        self._installed: list[signal.Signals] = []

    def install(self) -> None:
        """Take over each signal whose handler is the default action (or unknown to Python)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signums:
            if signum not in self._installed and signal.getsignal(signum) in (signal.SIG_DFL, None):
                signal.signal(signum, self._handle)
                self._installed.append(signum)

    def remove(self) -> None:
        """Put the default action back where our handler still stands."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self._installed:
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, signal.SIG_DFL)
        self._installed.clear()
        self.fired = None
        self.later = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.fired is not None:
            self.later += 1
            return
        self.fired = signal.Signals(signum)
        self.on_signal(self.fired)


#: The process's one instance (its ``signums`` and ``on_signal`` are the latest training's).
LATE = LateSignals((), lambda signum: None)


def take_over(signums: Sequence[signal.Signals], on_signal: Callable[[signal.Signals], None]) -> None:
    """After training: ``on_signal`` for the first of ``signums`` that would kill the process."""
    LATE.remove()
    LATE.signums = tuple(signums)
    LATE.on_signal = on_signal
    LATE.install()


def hand_back() -> None:
    """Training starts: the signals are a preemption's again (the default action back)."""
    LATE.remove()
