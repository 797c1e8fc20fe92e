"""Data loader workers that outlive the preemption signal their trainer handles.

torchrun and SLURM signal every process of the group, and torch's SIGTERM handler ends a
worker at once, so the trainer failed at its next fetch instead of snapshotting. In workers
the preemption signals are ignored (:class:`IgnoreSignals`); the loader still ends them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from typing import Any


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
