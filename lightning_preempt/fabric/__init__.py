"""The Fabric front-end: preemption safety for hand-written training loops on
``lightning.fabric.Fabric`` (docs/fabric.md).

``fabric.save``/``fabric.load`` through :class:`~lightning_preempt.ShardedAsyncCheckpointIO`
need nothing from here (lightning/checkpoint_io.py ``wrap_save``). :class:`Preemption` maps a loop onto
the engine (engine/engine.py) the way ``PreemptionCallback`` maps the Trainer's hooks.
"""

from __future__ import annotations

from lightning_preempt.fabric.preemption import Preemption
from lightning_preempt.preemption.controller import Preempted

__all__ = ["Preempted", "Preemption"]
