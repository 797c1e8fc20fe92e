"""What one save is, decided once where the save is decided and handed down as one value.

The engine makes a :class:`SaveOrder` for each of its saves (engine/engine.py ``save``,
``save_memory``); the front-end carries it through the framework as the ``storage_options``
argument Lightning passes unchanged to ``CheckpointIO.save_checkpoint``; the plugin completes
it (its fsspec options, Fabric's keys) and gives it to ``Saver.save``. A save the framework or
a user asks for (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``fabric.save``) gets one
from the plugin. The hops: docs/design.md "A save, hop by hop".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

#: Why a save is taken: the engine's periodic, notice, emergency, final and tier-0 saves, or a
#: save the framework or a user asked for.
Kind = Literal["periodic", "notice", "emergency", "final", "tier0", "user"]


@dataclasses.dataclass(frozen=True)
class SaveOrder:
    """One save's inputs.

    Args:
        url: where the checkpoint goes.
        kind: why it is taken (:data:`Kind`).
        watched: something may look for ``url`` before its commit (``ModelCheckpoint``, a
            user): rank 0 makes it exist before ``save`` returns. The engine's own disk saves
            are unwatched: the write job's claim creates the path (on an object store two
            round trips and a PUT fewer while training waits).
        options: fsspec options of this save (the plugin's merged under the caller's).
        fabric: ``fabric.save``'s converted state: asynchronous and collective wherever it
            is called (no "outside fit" for a Fabric loop).
        sharded_keys: top-level keys sharded besides the saver's own (Fabric: those that
            held a module or an optimizer).
    """

    url: str
    kind: Kind = "user"
    watched: bool = True
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fabric: bool = False
    sharded_keys: tuple[str, ...] = ()

    @property
    def overlap(self) -> bool:
        """Whether its copy may overlap the next step (staging/overlap.py): the emergency and
        final saves are waited for at once, so they are staged completely first."""
        return self.kind not in ("emergency", "final")

