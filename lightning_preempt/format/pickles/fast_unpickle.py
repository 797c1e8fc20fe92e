"""The fast path for the per-rank state files: C ``pickle`` with a tight ``find_class``.

``torch.load(weights_only=True)`` interprets the pickle in Python, one opcode at a time,
and rebuilds its allow-list dict for every object it reduces. A skeleton of 4000 tensor
placeholders took ~0.12 s that way, as long as reading 256 MiB of tensors (issue 26).

Here the same ``torch.load`` (zip reading, storages, ``map_location``) runs with the C
unpickler, whose only way to reach a callable is ``find_class``. ``find_class`` resolves a
small, fixed set, every member of which the weights-only path also allows
(:func:`fast_globals`): containers, :class:`TensorRef`, dense tensors
(``torch._utils._rebuild_tensor_v2``, storages, dtypes, sizes, devices), the ``bytes``
codec, and NumPy arrays/scalars when the pickle names NumPy. Anything else (sparse,
quantized or subclassed tensors, parameters, a global off the list) raises
:class:`OffFastPath` at its first mention, before anything it names is called, and the
caller loads the bytes again through ``weights_only`` (format/pickles/unpickle.py), which decides
and words the error. So this path accepts a subset of what that one accepts, never more;
docs/security.md.
"""

from __future__ import annotations

import io
import pickle
import types
from collections import OrderedDict
from typing import Any

import torch

from lightning_preempt.format import TensorRef


class OffFastPath(Exception):
    """The pickle needs something the fast path does not resolve (or is not a plain
    ``torch.save`` zip): load it through ``weights_only`` instead."""


def numpy_globals() -> list[Any]:
    """NumPy's array and scalar reconstruction (exact-resume RNG states), or nothing."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with every supported torch install
        return []
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    scalar = core.multiarray.scalar
    dtype_types = {type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                               np.uint32, np.uint64, np.float16, np.float32, np.float64)}  # fmt: skip
    # (A NumPy 1.x pickle loaded under NumPy 2 names numpy.core.*: refused, named in the error.)
    return [reconstruct, scalar, np.ndarray, np.dtype, *sorted(dtype_types, key=lambda t: t.__name__)]


def fast_globals(with_numpy: bool) -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` the fast path resolves (a subset of the weights-only
    allow-list plus :class:`TensorRef`; NumPy's names only with ``with_numpy``)."""
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("_codecs", "encode"): __import__("_codecs").encode,  # how protocol 2 pickles bytes
        ("builtins", "set"): set,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): bytearray,
        (TensorRef.__module__, TensorRef.__qualname__): TensorRef,
    }
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            module, _, name = str(value).rpartition(".")  # "torch.float32"
            allowed[(module, name)] = value
    if with_numpy:
        allowed |= _numpy_fast_globals()
    return allowed


def _numpy_fast_globals() -> dict[tuple[str, str], Any]:
    """NumPy arrays of the allowed dtypes (an RNG state), no scalars (those, and anything
    else, take the weights-only path). The weights-only unpickler checks the type of every
    object it BUILDs; C pickle does not, so the two callables whose result is BUILT later
    are wrapped to check it when they return: only an ``ndarray`` and a dtype of an
    allowed class ever reach ``__setstate__``."""
    import numpy as np

    names = {(g.__module__, g.__qualname__): g for g in numpy_globals()}
    dtype_types = tuple(g for g in names.values() if isinstance(g, type) and issubclass(g, np.dtype) and g is not np.dtype)
    reconstruct = next(g for g in names.values() if getattr(g, "__name__", "") == "_reconstruct")
    scalar = next(g for g in names.values() if getattr(g, "__name__", "") == "scalar")

    def dtype(*args: Any) -> Any:
        made = np.dtype(*args)
        if type(made) not in dtype_types:
            raise OffFastPath(f"numpy dtype {type(made).__name__}")
        return made

    def _reconstruct(cls: Any, *args: Any) -> Any:
        if cls is not np.ndarray:
            raise OffFastPath("numpy _reconstruct of a class other than ndarray")
        made = reconstruct(cls, *args)
        if type(made) is not np.ndarray:
            raise OffFastPath("numpy _reconstruct made something other than an ndarray")
        return made

    fast: dict[tuple[str, str], Any] = {}
    for key, g in names.items():
        if g is np.dtype:
            fast[key] = dtype
        elif g is reconstruct:
            fast[key] = _reconstruct
        elif g is not scalar and g not in dtype_types:  # ndarray (an argument of _reconstruct)
            fast[key] = g
    return fast


class _Unpickler(pickle.Unpickler):
    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise OffFastPath(f"{module}.{name}")
        return found


def _module(with_numpy: bool) -> types.SimpleNamespace:
    unpickler = type("_Unpickler", (_Unpickler,), {"allowed": fast_globals(with_numpy)})

    def load(*_: Any, **__: Any) -> Any:  # torch's legacy (non-zip) format: not ours
        raise OffFastPath("not a torch.save zip file")

    return types.SimpleNamespace(Unpickler=unpickler, load=load, __name__=__name__)


_MODULES = {False: _module(False), True: _module(True)}


def _first_record_is_protocol_2_pickle(data: bytes) -> bool:
    """``torch.save`` writes ``data.pkl`` first, stored, in pickle protocol 2, whose opcodes
    the weights-only unpickler reads. Other protocols add opcodes it refuses (C pickle
    does not): those files take its path and get its verdict."""
    if len(data) < 30 or not data.startswith(b"PK\x03\x04"):
        return False
    name_len = int.from_bytes(data[26:28], "little")
    extra_len = int.from_bytes(data[28:30], "little")
    start = 30 + name_len + extra_len
    return data[30 : 30 + name_len].endswith(b"/data.pkl") and data[start : start + 2] == b"\x80\x02"


def fast_load_state(data: bytes, map_location: Any) -> Any:
    """Unpickle a per-rank state file through the fast path, or raise :class:`OffFastPath`."""
    if not _first_record_is_protocol_2_pickle(data):
        raise OffFastPath("not a torch.save zip file starting with a protocol-2 data.pkl")
    try:
        return torch.load(
            io.BytesIO(data),
            map_location=map_location,
            weights_only=False,  # the restriction is _Unpickler.find_class
            pickle_module=_MODULES[b"numpy" in data],
        )
    except OffFastPath:
        raise
    except Exception as err:  # damaged, truncated…: weights_only gives the error its words
        raise OffFastPath(f"{type(err).__name__}") from err
