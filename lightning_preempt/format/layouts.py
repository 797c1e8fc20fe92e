"""Whether a list of tensors still has the layouts it had: the check a steady-state save makes
once per memo (the stager's routing, the DDP share) instead of rebuilding it."""

from __future__ import annotations

import operator
from typing import Any

import torch


class Layouts:
    """Each tensor's type, shape, dtype (and device, ``with_devices``) of ``values``, to compare
    later lists against with :meth:`same`: one C++ pass where torch has TorchDynamo's
    ``TensorGuards`` (what a compiled graph checks its inputs with; it also compares strides
    and ``requires_grad``: ~0.2 ms for 4000 tensors), else three C-level passes (~0.6 ms)."""

    def __init__(self, values: list[torch.Tensor], *, with_devices: bool = False) -> None:
        self._with_devices = with_devices
        self._guard = _guard(values)
        self._signature = _signature(values, with_devices) if self._guard is None else None

    @property
    def guarded(self) -> bool:
        """Whether the C++ check is in use."""
        return self._guard is not None

    def same(self, values: list[torch.Tensor]) -> bool:
        if self._guard is not None:
            return bool(self._guard.check(*values))
        return _signature(values, self._with_devices) == self._signature


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


def _signature(values: list[Any], with_devices: bool) -> tuple[list[Any], ...]:
    types = list(map(type, values))
    shapes = list(map(_SHAPE, values))
    dtypes = list(map(_DTYPE, values))
    if with_devices:
        return (types, shapes, dtypes, list(map(_DEVICE, values)))
    return (types, shapes, dtypes)


_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
