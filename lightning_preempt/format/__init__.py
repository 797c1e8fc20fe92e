"""The checkpoint format: every name rule, the manifest, where files live, splitting
Lightning's dict into DCP tensors and a per-rank skeleton, and unpickling it safely.

Nothing here writes. Modules that need no torch (names, manifest, layout, pickle_scan,
allowlists, state_replay, metadata_scan, fast_guard)
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

    def __reduce__(self) -> tuple[type[TensorRef], tuple[str]]:
        # One REDUCE instead of NEWOBJ + BUILD of a state dict: fewer objects for
        # torch.save to visit (the skeleton is pickled while training waits) and one
        # allow-list check instead of two in weights_only loading, per tensor. Old
        # checkpoints (NEWOBJ + BUILD) load as before.
        return (TensorRef, (self.key,))
