"""The engine's part of an agreed preemption: the snapshot of the agreed step and its drain,
run inside the controller's unconditional sequence (preemption/controller.py), what the exit
log names as the newest safe step, and the report of a notice's snapshot."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from lightning_preempt.engine import tier_policy
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.engine.ledger_writer import Ledger, record_preemption
from lightning_preempt.errors import CheckpointError
from lightning_preempt.preemption.controller import Preempted, PreemptionController
from lightning_preempt.save.history import SaveRecord
from lightning_preempt.save.order import Kind
from lightning_preempt.save.saver import Saver

log = logging.getLogger(__name__)


class Saving(Protocol):
    """What these functions use of the engine (engine/engine.py's ``Engine``), every rank."""

    config: PreemptionConfig
    controller: PreemptionController
    ledger: Ledger
    leader: bool
    resumed_from: str | None
    last_saved_step: int | None
    last_saved_path: str | None
    snapshot_hooks: list[Callable[[int], None]]

    @property
    def saver(self) -> Saver: ...

    def wait(self) -> None:
        """Every rank: wait for the saves in flight; a failure on any rank raises on every rank."""

    def save(self, step: int, kind: Kind = "periodic") -> None:
        """Every rank: save ``step`` (asynchronous) unless it is saved already."""


def preempt(engine: Saving, step: int) -> None:
    """Every rank: the snapshot of ``step`` and its drain, inside the controller's unconditional
    sequence. Raises ``Preempted`` (recorded in the ledger)."""
    controller = engine.controller

    def snapshot() -> None:
        try:
            engine.wait()  # the saves in flight are not lost: let them commit first (in step order)
        except CheckpointError as err:
            log.error("lightning_preempt: the in-flight save failed (%s); snapshotting anyway", err)
            engine.last_saved_step = None
        if step in (engine.last_saved_step, 0):
            controller.mark(f"step {step} is already committed; no snapshot needed")
            return
        engine.save(step, kind="emergency")
        controller.mark(f"staged step {step}")
        engine.wait()
        controller.mark(f"committed step {step}")
        for hook in list(engine.snapshot_hooks):
            hook(step)

    def drain(budget: float) -> str:
        path = engine.last_saved_path
        saved = (path, engine.last_saved_step) if engine.leader and path is not None else None
        return tier_policy.drain_within_grace(engine.saver, dirpath=engine.config.dirpath, step=step, budget=budget,
                                              mark=controller.mark, saved=saved)  # fmt: skip

    try:
        controller.emergency(step, snapshot=snapshot, drain=drain, safe_step=lambda: safe_step(engine),
                             leader=engine.leader)  # fmt: skip
    except Preempted:
        record_preemption(engine.ledger, controller, engine.saver, step=step)
        raise


def safe_step(engine: Saving) -> str:
    """The newest step this run can be resumed from, for the exit log."""
    done = committed(engine.saver.history)
    if done:
        return f"step {done[-1].step} ({done[-1].path})"
    if engine.resumed_from is not None:
        return f"step {engine.last_saved_step} ({engine.resumed_from}, the checkpoint this run resumed from)"
    return "no checkpoint of this run committed (the newest in dirpath, if any)"


def report_notice_snapshot(engine: Saving, step: int) -> None:
    """Log the snapshot a notice asked for (``on_notice="continue"``: training does not wait
    for it) and, from the job thread behind the save, whether it committed."""
    controller, history = engine.controller, engine.saver.history
    source = controller.notice.source if controller.notice is not None else "a"
    controller.mark(f"{source} notice: snapshot of step {step} staged; training goes on until the signal")

    def outcome() -> None:
        rec = next((r for r in reversed(history) if r.step == step), None)
        ok = rec is not None and rec.committed_s is not None and rec.error is None
        controller.mark(f"committed step {step} (the {source} notice's snapshot)" if ok else
                        f"the {source} notice's snapshot of step {step} did not commit")  # fmt: skip

    engine.saver.submit(outcome)


def committed(history: Sequence[SaveRecord]) -> list[SaveRecord]:
    """The saves of this process that committed, oldest first."""
    return [r for r in list(history) if r.committed_s is not None and r.error is None]
