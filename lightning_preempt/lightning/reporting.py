"""Telling people what happened: save metrics through the trainer's loggers, and what a
resume skipped and lost. Runs on the training thread (loggers are not thread-safe)."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl

from lightning_preempt.engine.engine import Engine

log = logging.getLogger(__name__)


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
            metrics = {
                "checkpoint/blocking_s": record.blocking_s,
                "checkpoint/commit_s": record.committed_s or 0.0,
                "checkpoint/bytes": float(record.bytes),
                "checkpoint/throughput_MBps": (record.throughput_bps or 0.0) / 1e6,
            }
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
