"""What the Trainer's logs say about our checkpoints: ours (each save's figures through its
loggers, what a resume lost; on the training thread: loggers are not thread-safe) and
Lightning's messages that our auto-resume route and exact resume make untrue, filtered, with its
"Restoring states from …" lines naming the real checkpoint, not the resume pointer
(docs/design.md, "Auto-resume")."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any, cast

import lightning.pytorch as pl

from lightning_preempt.engine.engine import Engine

log = logging.getLogger(__name__)

NOT_RESUMABLE_LOADER = r"You're resuming from a checkpoint that ended before the epoch ended"
"""Lightning's warning on a mid-epoch restart that a loader is not resumable: untrue once exact
resume put every loader back (:attr:`ExactResume.positions_restored`). Matched by its start."""


class QuietWarning:
    """One of Lightning's warnings, not shown while installed: our own ``"ignore"`` entry at the
    front of ``warnings.filters``, removed by identity (no ``catch_warnings`` block spans two
    hooks, and exiting one would undo filters others added meanwhile)."""

    def __init__(self, message: str, category: type[Warning] = Warning) -> None:
        self.message = message
        self.category = category
        self._entry: object | None = None

    def install(self) -> None:
        """From now on until :meth:`remove`, the warning is not shown (in this process)."""
        self.remove()
        warnings.filterwarnings("ignore", message=self.message, category=self.category)
        self._entry = warnings.filters[0]  # filterwarnings inserts at the front

    def remove(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            return
        # `warnings.filters` is looked up now: catch_warnings (pytest's too) swaps the list.
        filters = cast(list[object], warnings.filters)  # typeshed says Sequence; it is the list
        for i, item in enumerate(filters):
            if item is entry:
                # No cache to reset: an "ignore" leaves no entry in the warning registries.
                del filters[i]
                return


AUTO_RESUME_WARNINGS = (
    r".*ckpt_path=None\)` was called without a model",
    r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint",
)
"""Lightning's warnings about "last" checkpoints when ``fit()`` gets no ``ckpt_path`` and an
``OnExceptionCheckpoint`` is present: exactly our auto-resume route, so the text misleads."""


@contextlib.contextmanager
def quiet_auto_resume_warnings() -> Iterator[None]:
    """:data:`AUTO_RESUME_WARNINGS` not shown inside the block (``_compat.quiet_ckpt_path_choice``)."""
    quiet = [QuietWarning(message) for message in AUTO_RESUME_WARNINGS]
    for q in quiet:
        q.install()
    try:
        yield
    finally:
        for q in quiet:
            q.remove()


class PointerNames(logging.Filter):
    """While installed, Lightning's rank-zero log lines ("Restoring states from …") name the
    checkpoint the resume pointer stands for (the path is replaced in the record's message)."""

    def __init__(self) -> None:
        super().__init__()
        self._names: tuple[str, str] | None = None
        self._logger: logging.Logger | None = None

    def install(self, pointer: str, checkpoint: str) -> None:
        """From now on ``pointer`` reads ``checkpoint`` in Lightning's rank-zero log."""
        from lightning_utilities.core import rank_zero  # the logger rank_zero_info writes to

        self.remove()
        self._names = (pointer, checkpoint)
        self._logger = rank_zero.log
        self._logger.addFilter(self)

    def remove(self) -> None:
        if self._logger is not None:
            self._logger.removeFilter(self)
        self._logger = None
        self._names = None

    def filter(self, record: logging.LogRecord) -> bool:
        names = self._names
        if names is not None and isinstance(record.msg, str) and names[0] in record.msg:
            record.msg = record.msg.replace(*names)
        return True


class SaveReporter:
    """Logs each finished save once: blocking time, time to commit, bytes, throughput, and
    the run's figures so far (preemptions, steps lost, goodput from ``engine``'s ledger, looked
    up late: set-up replaces it). Rank 0 only, ``logger.log_metrics`` directly: no collective."""

    def __init__(self, engine: Engine | None = None) -> None:
        self._last_started = float("-inf")  # the plugin trims its history: remember by time, not index
        self._engine = engine

    def report(self, trainer: pl.Trainer, history: list[Any]) -> None:
        for metrics, step in self.collect(history, is_global_zero=trainer.is_global_zero):
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def collect(self, history: list[Any], *, is_global_zero: bool) -> list[tuple[dict[str, float], int]]:
        """The ``(metrics, step)`` of each save finished since the last call, in order (none on
        ranks other than 0); the caller logs them (the Trainer's loggers, ``fabric.log_dict``)."""
        out: list[tuple[dict[str, float], int]] = []
        run: dict[str, float] | None = None
        for record in history:
            if record.started <= self._last_started:
                continue
            if record.committed_s is None and record.error is None:
                break  # still in flight: report it later, in order
            self._last_started = record.started
            if record.error is not None or not is_global_zero:
                continue
            metrics = {"checkpoint/blocking_s": record.blocking_s, "checkpoint/commit_s": record.committed_s or 0.0,
                       "checkpoint/bytes": float(record.bytes),
                       "checkpoint/throughput_MBps": (record.throughput_bps or 0.0) / 1e6}  # fmt: skip
            if run is None:
                run = self._engine.ledger.figures() if self._engine is not None else {}
            metrics.update(run)
            out.append((metrics, max(record.step, 0)))
        return out


def report_resume(trainer: pl.Trainer, state: dict[str, Any] | None, *, log_metrics: bool = True) -> None:
    """After a restore: the step, and whether steps were lost (from the saved callback state)."""
    if state is None or not trainer.is_global_zero:
        return
    step = trainer.global_step
    if state.get("kind") == "emergency":
        how = f"the snapshot taken after {state.get('signal') or 'a signal'}: 0 steps lost"
    else:
        how = f"a {state.get('kind') or 'periodic'} checkpoint: steps trained after it (if any) are repeated"
    log.info("lightning_preempt: resumed at step %d from %s", step, how)
    for logger in trainer.loggers if log_metrics else ():
        logger.log_metrics({"preempt/resumed_from_step": float(step)}, step=step)
