"""The checkpoint format: every name rule, the manifest, where files live, splitting
Lightning's dict into DCP tensors and a per-rank skeleton, and unpickling it safely.

Nothing here writes. Modules that need no torch (names, manifest, layout, pickle_scan,
allowlists, state_replay, metadata_scan)
import none, so the operator CLI can read checkpoints without it.

:class:`TensorRef` is defined in this package's ``__init__`` on purpose: every
checkpoint's skeleton pickles it as ``lightning_preempt.format.TensorRef``. Never move
or rename it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Placeholder in the skeleton for a tensor stored in the DCP shards under ``key``."""

    key: str

