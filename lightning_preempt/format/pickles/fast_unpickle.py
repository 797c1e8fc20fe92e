"""The fast path for state files: C ``pickle`` with a tight ``find_class`` (docs/security.md).

The weights-only unpickler runs in Python (~0.12 s for 4000 placeholders). Here C pickle
resolves a small set weights-only also allows (:func:`fast_globals`), after the opcode check;
anything else raises :class:`OffFastPath` and the caller loads through ``weights_only``.
"""

from __future__ import annotations

import io
import pickle
import types
from collections import OrderedDict
from typing import Any

import torch

from lightning_preempt.format import TensorDict, TensorRef, tensor_from_bytes
from lightning_preempt.format.pickles.allowlists import TORCH_WEIGHTS_ONLY_GLOBALS
from lightning_preempt.format.pickles.fast_guard import FastRefused, check_fast_pickle
from lightning_preempt.format.pickles.state_replay import archived_pickle


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
    allow-list plus the placeholders; NumPy's names only with ``with_numpy``)."""
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("_codecs", "encode"): __import__("_codecs").encode,  # how protocol 2 pickles bytes
        (TensorRef.__module__, TensorRef.__qualname__): TensorRef,
        (TensorDict.__module__, TensorDict.__qualname__): TensorDict,  # checks its arguments
        (tensor_from_bytes.__module__, tensor_from_bytes.__qualname__): tensor_from_bytes,  # checks its arguments
    }
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            module, _, name = str(value).rpartition(".")  # "torch.float32"
            allowed[(module, name)] = value
    if with_numpy:
        allowed |= _numpy_fast_globals()
    return allowed


def _numpy_fast_globals() -> dict[tuple[str, str], Any]:
    """NumPy arrays of the allowed dtypes, no scalars. C pickle does not type-check what it
    BUILDs, so the two callables whose result is BUILT are wrapped to check it."""
    import numpy as np

    reconstruct, _scalar, _ndarray, _dtype, *dtype_classes = numpy_globals()
    dtype_types = tuple(dtype_classes)

    def dtype(obj: Any, align: bool = False, copy: bool = False) -> Any:
        # Always a copy: np.dtype("f8", False, False) is NumPy's shared float64 descriptor,
        # and the BUILD that follows sets its state (a pickle of a dtype asks for a copy).
        made = np.dtype(obj, align, True)
        if type(made) not in dtype_types:
            raise OffFastPath(f"numpy dtype {type(made).__name__}")
        return made

    def _reconstruct(cls: Any, shape: Any, typecode: Any) -> Any:
        if cls is not np.ndarray or shape != (0,):  # what ndarray.__reduce__ writes; BUILD sets the shape
            raise OffFastPath("numpy _reconstruct of a class other than ndarray, or of a shape other than (0,)")
        made = reconstruct(cls, shape, typecode)
        if type(made) is not np.ndarray:
            raise OffFastPath("numpy _reconstruct made something other than an ndarray")
        return made

    # ndarray only as an argument of _reconstruct; no scalars, no dtype classes
    fast = ((np.ndarray, np.ndarray), (np.dtype, dtype), (reconstruct, _reconstruct))
    return {(g.__module__, g.__qualname__): f for g, f in fast}


def _module(with_numpy: bool) -> types.SimpleNamespace:
    allowed = fast_globals(with_numpy)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = allowed.get((module, name))
            if found is None:
                raise OffFastPath(f"{module}.{name}")
            return found

    def load(*_: Any, **__: Any) -> Any:  # torch's legacy (non-zip) format: not ours
        raise OffFastPath("not a torch.save zip file")

    # What the opcode check lets a GLOBAL name: these globals, and the legacy storage
    # types of torch.save's persistent ids (torch's find_class resolves those before ours).
    names = {f"{m}.{n}": g for (m, n), g in allowed.items()}
    storages = {n for n in TORCH_WEIGHTS_ONLY_GLOBALS if n.startswith("torch.") and n.count(".") == 1 and n.endswith("Storage")}  # fmt: skip
    array = "numpy.ndarray"  # only an argument of _reconstruct, never called (np.ndarray(shape) allocates)
    callables = {n for n, g in names.items() if callable(g) and n != array and not isinstance(g, torch.dtype)}
    buildable = {n for n, g in names.items() if g in (TensorRef, OrderedDict) or (n.startswith("numpy.") and n != array)}
    guard = {
        "globals_allowed": frozenset(names) | storages,
        "callables": frozenset(callables),
        "buildable": frozenset(buildable),
        "dict_like": frozenset({"collections.OrderedDict"}),
    }
    return types.SimpleNamespace(Unpickler=Unpickler, load=load, __name__=__name__, guard=guard)


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
    module = _MODULES[b"numpy" in data]
    try:
        archived_pickle(data)  # refuses an archive that two zip readers could read differently
        # and the check walks the very bytes torch.load unpickles: its own reader's record
        pkl = torch._C.PyTorchFileReader(io.BytesIO(data)).get_record("data.pkl")
        check_fast_pickle(pkl, **module.guard)  # before C pickle runs a single opcode
    except FastRefused as err:
        raise OffFastPath(str(err)) from None
    except Exception as err:  # not an archive both zip readers read alike
        raise OffFastPath(f"{type(err).__name__}") from err
    try:  # weights_only=False: the restriction is the opcode check above and Unpickler.find_class
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False, pickle_module=module)
    except OffFastPath:
        raise
    except Exception as err:  # damaged, truncated…: weights_only gives the error its words
        raise OffFastPath(f"{type(err).__name__}") from err
