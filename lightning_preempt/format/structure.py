"""The structure key of a save: one per save, computed by the saver from the state's flat
tensors before anything is staged, and handed to every stage that keeps what it derived from
the structure (the DDP share, the stager's routing and the budget's split, DCP's local plan
and with it the shard files' layout). A stage reuses what it kept while the key it is given
is the very key it kept it for (``is``): one check per save, not one per stage."""

from __future__ import annotations

import operator
from typing import Any

import torch


class Structure:
    """The key: the tensors' keys in order and each tensor's type, shape, dtype and device,
    compared by :meth:`same` in one C++ pass where torch has TorchDynamo's ``TensorGuards``
    (what a compiled graph checks its inputs with; it also compares strides and
    ``requires_grad``: ~0.2 ms for 4000 tensors), else four C-level passes (~0.8 ms). Stages
    compare keys by identity: :class:`Structures` hands out the same object while it holds."""

    __slots__ = ("_guard", "_signature", "keys", "plain")

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        values = list(tensors.values())
        self.keys = list(tensors)
        #: every tensor a plain ``torch.Tensor`` (a ``DTensor``'s placements are not in the key)
        self.plain = set(map(type, values)) <= {torch.Tensor}
        self._guard = _guard(values)
        self._signature = _signature(values) if self._guard is None else None

    @property
    def guarded(self) -> bool:
        """Whether the C++ check is in use."""
        return self._guard is not None

    def same(self, tensors: dict[str, torch.Tensor]) -> bool:
        if len(tensors) != len(self.keys) or list(tensors) != self.keys:
            return False
        values = list(tensors.values())
        return bool(self._guard.check(*values)) if self._guard is not None else _signature(values) == self._signature


class Structures:
    """One saver's structure keys: :meth:`key` returns the last key while it still holds."""

    def __init__(self) -> None:
        self._last: Structure | None = None

    def key(self, tensors: dict[str, torch.Tensor]) -> Structure:
        """The structure key of ``tensors`` (a save's flat tensors, all of them)."""
        last = self._last
        if last is not None and last.same(tensors):
            return last
        self._last = Structure(tensors)
        return self._last


def _guard(values: list[torch.Tensor]) -> Any:
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    try:
        from torch._C._dynamo import guards

        tensor_guards: Any = guards.TensorGuards  # (its stub types the per-tensor lists wrongly)
        guard = tensor_guards(*values, dynamic_dims_sizes=[list(t.size()) for t in values],
                              dynamic_dims_strides=[list(t.stride()) for t in values])  # fmt: skip
        return guard if guard.check(*values) else None
    except Exception:  # (a private API: another torch may spell it otherwise, or lack it)
        return None


def _signature(values: list[Any]) -> tuple[list[Any], ...]:
    return (list(map(type, values)), list(map(_SHAPE, values)), list(map(_DTYPE, values)), list(map(_DEVICE, values)))


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
