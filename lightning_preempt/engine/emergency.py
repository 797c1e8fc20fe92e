"""The engine's side of an agreed preemption: the emergency snapshot and its drain, which the
controller's unconditional sequence (``preemption/controller.py``) runs within the grace
period; the step that is safe to resume from (the exit log); and whether a cloud notice's
snapshot committed (``on_notice="continue"``: training does not wait for it)."""

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
from lightning_preempt.save.saver import Saver

log = logging.getLogger(__name__)


class Snapshotter(Protocol):
    """What the emergency sequence uses of the engine (``engine/engine.py``'s ``Engine``)."""

    config: PreemptionConfig
    controller: PreemptionController
    ledger: Ledger
    leader: bool
    last_saved_step: int | None
    last_saved_path: str | None
    snapshot_hooks: list[Callable[[int], None]]
    resumed_from: str | None

    @property
    def saver(self) -> Saver: ...

    def wait(self) -> None: ...

    def save(self, step: int, kind: str = "periodic") -> None: ...


def emergency(engine: Snapshotter, step: int) -> None:
    """Every rank: the agreed preemption at ``step``. Raises ``Preempted`` (recorded in the ledger)."""

    def snapshot() -> None:
        try:
            engine.wait()  # an in-flight periodic save is not lost: let it commit first
        except CheckpointError as err:
            log.error("lightning_preempt: the in-flight save failed (%s); snapshotting anyway", err)
            engine.last_saved_step = None
        if step in (engine.last_saved_step, 0):
            engine.controller.mark(f"step {step} is already committed; no snapshot needed")
            return
        engine.save(step, kind="emergency")
        engine.controller.mark(f"staged step {step}")
        engine.wait()
        engine.controller.mark(f"committed step {step}")
        for hook in list(engine.snapshot_hooks):
            hook(step)

    def drain(budget: float) -> str:
        path = engine.last_saved_path
        saved = (path, engine.last_saved_step) if engine.leader and path is not None else None
        return tier_policy.drain_within_grace(engine.saver, dirpath=engine.config.dirpath, step=step, budget=budget,
                                              mark=engine.controller.mark, saved=saved)  # fmt: skip

    def safe() -> str:
        return safe_step(engine.saver.history, engine.resumed_from, engine.last_saved_step)

    try:
        engine.controller.emergency(step, snapshot=snapshot, drain=drain, safe_step=safe, leader=engine.leader)
    except Preempted:
        record_preemption(engine.ledger, engine.controller, engine.saver, step=step)
        raise


def committed_steps(history: Sequence[SaveRecord]) -> list[SaveRecord]:
    """The saves of this process that committed, oldest first."""
    return [r for r in list(history) if r.committed_s is not None and r.error is None]


def safe_step(history: Sequence[SaveRecord], resumed_from: str | None, resumed_step: int | None) -> str:
    """The newest step this run can be resumed from, for the exit log."""
    done = committed_steps(history)
    if done:
        return f"step {done[-1].step} ({done[-1].path})"
    if resumed_from is not None:
        return f"step {resumed_step} ({resumed_from}, the checkpoint this run resumed from)"
    return "no checkpoint of this run committed (the newest in dirpath, if any)"


def report_notice_snapshot(controller: PreemptionController, saver: Saver, step: int) -> None:
    """Log the snapshot a notice asked for and, from the job thread behind the save, whether
    it committed."""
    notice = controller.notice
    source = notice.source if notice is not None else "a"
    controller.mark(f"{source} notice: snapshot of step {step} staged; training goes on until the signal")
    history = saver.history

    def committed() -> None:
        rec = next((r for r in reversed(history) if r.step == step), None)
        ok = rec is not None and rec.committed_s is not None and rec.error is None
        controller.mark(f"committed step {step} (the {source} notice's snapshot)" if ok else
                        f"the {source} notice's snapshot of step {step} did not commit")  # fmt: skip

    saver.submit(committed)
