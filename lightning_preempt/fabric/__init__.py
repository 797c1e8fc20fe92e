"""The Fabric front-end (docs/fabric.md): :class:`Preemption` maps a hand-written loop on
``lightning.fabric.Fabric`` onto the engine the way ``PreemptionCallback`` maps the Trainer's hooks."""

from __future__ import annotations

from lightning_preempt.fabric.preemption import Preemption
from lightning_preempt.preemption.controller import Preempted

__all__ = ["Preempted", "Preemption"]
