"""Signal handlers that only set a flag: no I/O, locks or collectives in a handler.

Ranks agree on the flag at a step boundary. Handlers chain to the one installed before and
are restored afterwards; one that outlives its owner behaves like the one it replaced.
After training (:class:`LateSignals`) a signal exits with ``exit_code`` instead of killing
the process (-15, which SLURM records as FAILED). Data loader workers ignore the preemption
signals their trainer handles (:func:`shield_workers`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
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

    name = "signal"

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


# ---- after training ---------------------------------------------------------------------------
class LateSignals:
    """Handlers for ``signums`` that call ``on_signal`` once (main thread only): the first signal
    whose handler is still the default calls ``on_signal``, later ones are noted. One set of
    handlers per process, so :data:`LATE` is the one instance; :func:`hand_back` restores the
    default before training again."""

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


# ---- data loader workers -----------------------------------------------------------------------
# torchrun and SLURM signal every process of the group, and torch's SIGTERM handler ends a worker
# at once, so the trainer failed at its next fetch instead of snapshotting. In workers the
# preemption signals are ignored; the loader still ends them.
class IgnoreSignals:
    """A ``worker_init_fn``: ignore ``signals`` in this worker, then run ``inner`` (picklable:
    loaders whose workers are spawned pickle it)."""

    def __init__(self, signals: Sequence[signal.Signals], inner: Callable[[int], Any] | None) -> None:
        self.signals = tuple(signals)
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def shield_workers(loaders: Sequence[Any], signals: Sequence[signal.Signals]) -> int:
    """Make the preemption ``signals`` ignored in the workers of every loader with workers,
    from its next iterator on; returns how many loaders were changed (once per loader)."""
    changed = 0
    for loader in loaders:
        current = getattr(loader, "worker_init_fn", None)
        if int(getattr(loader, "num_workers", 0) or 0) == 0 or isinstance(current, IgnoreSignals):
            continue
        loader.worker_init_fn = IgnoreSignals(signals, current)
        changed += 1
    return changed
