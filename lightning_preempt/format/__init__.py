"""The checkpoint format: name rules, the manifest, the split into DCP tensors and a per-rank
skeleton, safe unpickling. Nothing here writes; the torch-free modules import no torch.

:class:`TensorRef` and :class:`TensorDict` live here on purpose: every skeleton pickles them
as ``lightning_preempt.format.<name>``. Never move or rename them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Placeholder in the skeleton for a tensor stored in the DCP shards under ``key``."""

    key: str

    def __reduce__(self) -> tuple[type[TensorRef], tuple[str]]:
        # one REDUCE, not NEWOBJ + BUILD: fewer objects to pickle while training waits, one
        # allow-list check per tensor (old NEWOBJ + BUILD checkpoints still load)
        return (TensorRef, (self.key,))


@dataclasses.dataclass(frozen=True)
class TensorDict:
    """Placeholder in a format-3 skeleton for a dict whose values are all tensors in the DCP
    shards (a module's ``state_dict``): the next ``count`` keys of the skeleton's key list
    (format/skeleton.py), each ``prefix + "/" + the dict's key``. ``ordered``: an
    ``OrderedDict`` whose attributes are ``attrs`` (``_metadata``: the module versions)."""

    prefix: str
    count: int
    ordered: bool
    attrs: dict[str, Any]

    def __post_init__(self) -> None:
        # its arguments come from storage (the unpickler calls it): each is checked
        if not (isinstance(self.prefix, str) and type(self.count) is int and self.count >= 0):
            raise ValueError(f"TensorDict: prefix {self.prefix!r}, count {self.count!r}")
        if type(self.ordered) is not bool or type(self.attrs) is not dict:
            raise ValueError("TensorDict: ordered is not a bool or attrs not a dict")
        if not all(isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in self.attrs):
            raise ValueError(f"TensorDict: attribute names {sorted(map(repr, self.attrs))}")

    def __reduce__(self) -> tuple[type[TensorDict], tuple[str, int, bool, dict[str, Any]]]:
        return (TensorDict, (self.prefix, self.count, self.ordered, self.attrs))


#: the largest tensor the skeleton keeps inline, as bytes (write/skeleton_bytes.py)
INLINE_TENSOR_MAX_BYTES = 1 << 16
#: the dtypes an inline tensor may have (plain numbers: no quantized or bit-packed types)
INLINE_TENSOR_DTYPES = frozenset(
    {"bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
     "float16", "bfloat16", "float32", "float64", "complex64", "complex128"}
)  # fmt: skip


def tensor_from_bytes(dtype: str, shape: tuple[int, ...], data: str) -> Any:
    """A small CPU tensor kept inline in the skeleton, from ``latin-1`` text (what protocol 2
    makes of bytes, without the ``_codecs.encode`` global). Pickled by name: never move it.
    Its arguments come from storage, so each is checked."""
    import torch  # not at import time: the operator CLI imports this package without torch

    if not (isinstance(dtype, str) and dtype in INLINE_TENSOR_DTYPES):
        raise ValueError(f"tensor_from_bytes: {dtype!r} is not a dtype of an inline tensor")
    kind = getattr(torch, dtype)
    if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
        raise ValueError(f"tensor_from_bytes: the shape {shape!r} is not a tuple of sizes")
    if not isinstance(data, str) or len(data) > INLINE_TENSOR_MAX_BYTES:
        raise ValueError("tensor_from_bytes: the data is not the text of an inline tensor's bytes")
    numel = math.prod(shape)
    if numel * kind.itemsize != len(data):
        raise ValueError(f"tensor_from_bytes: {len(data)} bytes for {numel} elements of {dtype}")
    if numel == 0:
        return torch.empty(shape, dtype=kind)
    raw = bytearray(data.encode("latin-1"))  # UnicodeEncodeError (a ValueError) past U+00FF
    return torch.frombuffer(raw, dtype=torch.uint8).view(kind).reshape(shape)
