"""Unpickling what storage hands us without running code from it (docs/security.md).

Two roads. A state file that the opcode check (check.py, rules ``FAST``) passes is loaded by
C pickle resolving the names of allowlists.FAST_GLOBALS (~10x faster than torch's Python
unpickler); any other goes to ``torch.load(weights_only=True)`` with the package's extra
names scoped to that one call (never ``add_safe_globals``), which decides and words the
error (:class:`UntrustedCheckpointError` names the opt-in). DCP's ``.metadata`` goes through
metadata.py's restricted unpickler with sealed stand-ins of torch's classes.
"""

from __future__ import annotations

import enum
import functools
import importlib
import io
import pickle
import re
import types
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.format import tensor_from_bytes
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.pickles import allowlists as names
from lightning_preempt.format.pickles.check import (
    FAST,
    Refused,
    archived_pickle,
    corrupt_state_error,
    untrusted_state_error,
    walk,
)
from lightning_preempt.format.pickles.metadata import (
    RewriteRefused,
    check_dcp_structure,
    stand_in_class,
    unpickle_metadata,
)
from lightning_preempt.format.skeleton import map_leaves

#: ``.metadata`` larger than this is refused unread when the manifest does not bound it.
MAX_METADATA_BYTES = 256 << 20

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _resolve(name: str) -> Any:
    """The object an allowed ``module.name`` names (``None``: not in the installed torch/NumPy)."""
    module, attr = _pair(name)
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


def _pair(name: str) -> tuple[str, str]:
    module, _, attr = name.rpartition(".")
    return module, attr


# ---- the per-rank state files -------------------------------------------------------------
def skeleton_safe_globals() -> list[Any]:
    """On top of ``weights_only``'s defaults: the placeholders, inline tensors and NumPy
    (RNG states); all a ``Trainer.fit`` puts there (Lightning 2.6)."""
    return [g for g in map(_resolve, sorted(names.OURS | names.NUMPY_GLOBALS)) if g is not None]


def load_state_bytes(data: bytes, *, path: str, trusted: bool = False, map_location: Any = None) -> Any:
    """Unpickle one state file; ``trusted``: full unpickling (the user opted in)."""
    state = _load_state(data, path=path, trusted=trusted, map_location=map_location)
    if map_location is not None and _INLINE in data:  # inline tensors are made on the CPU
        state = apply_map_location(state, map_location)
    return state


#: how a state file names an inline tensor's constructor (protocol 2: ``GLOBAL module name``)
_INLINE = f"{tensor_from_bytes.__module__}\n{tensor_from_bytes.__qualname__}".encode()


def _load_state(data: bytes, *, path: str, trusted: bool, map_location: Any) -> Any:
    location = map_location if map_location is not None else "cpu"
    if trusted:
        return torch.load(io.BytesIO(data), map_location=location, weights_only=False)
    try:
        return fast_load_state(data, location)
    except OffFastPath:
        pass  # weights_only decides (it allows a superset) and words any error
    # NumPy's globals only when the bytes name them: weights_only rebuilds the allowed dict
    # per object, so a shorter list is faster (and never less safe)
    extra = skeleton_safe_globals() if b"numpy" in data else [_resolve(n) for n in sorted(names.OURS)]
    try:
        with torch.serialization.safe_globals(extra):  # scoped to this call
            return torch.load(io.BytesIO(data), map_location=location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise untrusted_state_error(_unsupported_global(err), _refusal(err), path) from None
    except (RuntimeError, ValueError, TypeError, IndexError, EOFError, KeyError, OSError) as err:
        # (TypeError, IndexError: a hand-made pickle that BUILDs a tensor with a bad state,
        # or pops more than it pushed, inside torch's weights-only unpickler)
        first = str(err).splitlines()[0] if str(err) else ""
        raise corrupt_state_error(f"{type(err).__name__}: {first}", path) from err


def _unsupported_global(err: BaseException) -> str | None:
    match = _GLOBAL_RE.search(str(err))
    if match is None:
        return None
    name = match.group(1)
    return name if "." in name else f"builtins.{name}"  # torch names builtins without their module


def _refusal(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines()]
    after = lines[lines.index("WeightsUnpickler error:") + 1 :] if "WeightsUnpickler error:" in lines else lines
    detail = next((line for line in after if line and not line.startswith(("Weights only", "Please file"))), "")
    return detail or type(err).__name__


# ---- the fast road ------------------------------------------------------------------------
class OffFastPath(Exception):
    """The pickle needs something the fast road does not resolve (or is not a plain
    ``torch.save`` zip): load it through ``weights_only`` instead."""


def fast_globals(with_numpy: bool) -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` C pickle resolves on the fast road (allowlists.FAST_GLOBALS;
    NumPy's only ``with_numpy``). C pickle does not type-check what it BUILDs, so the two
    NumPy callables whose result is BUILT are wrapped to check it."""
    allowed = {_pair(n): _resolve(n) for n in names.FAST_GLOBALS if not n.startswith("numpy")}
    if with_numpy:
        import numpy as np

        dtype_types = tuple(type(np.dtype(code)) for code in names.NUMPY_DTYPES)
        reconstruct_name = next(n for n in names.FAST_CALLABLES if n.endswith("._reconstruct"))
        reconstruct = _resolve(reconstruct_name)

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

        # ndarray only as an argument of _reconstruct (the check allows no call of it)
        allowed |= {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): dtype,
                    _pair(reconstruct_name): _reconstruct}  # fmt: skip
    return {k: v for k, v in allowed.items() if v is not None}


def _pickle_module(with_numpy: bool) -> types.SimpleNamespace:
    """What ``torch.load`` takes as ``pickle_module``: C pickle with a tight ``find_class``."""
    allowed = fast_globals(with_numpy)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = allowed.get((module, name))
            if found is None:
                raise OffFastPath(f"{module}.{name}")
            return found

    def load(*_: Any, **__: Any) -> Any:  # torch's legacy (non-zip) format: not ours
        raise OffFastPath("not a torch.save zip file")

    return types.SimpleNamespace(Unpickler=Unpickler, load=load, __name__=__name__)


_MODULES = {False: _pickle_module(False), True: _pickle_module(True)}


def fast_load_state(data: bytes, map_location: Any) -> Any:
    """Unpickle a per-rank state file on the fast road, or raise :class:`OffFastPath`."""
    if not data.startswith(b"PK\x03\x04"):
        raise OffFastPath("not a torch.save zip file")
    try:
        _, has_record = archived_pickle(data)  # refuses an archive two zip readers read differently
        # and the check walks the very bytes torch.load unpickles: its own reader's record
        walk(torch._C.PyTorchFileReader(io.BytesIO(data)).get_record("data.pkl"), FAST, has_record)
    except Refused as err:  # before C pickle runs a single opcode
        raise OffFastPath(str(err)) from None
    except Exception as err:  # not an archive both zip readers read alike, a broken pickle
        raise OffFastPath(f"{type(err).__name__}") from err
    try:  # weights_only=False: the restriction is the check above and Unpickler.find_class
        module = _MODULES[b"numpy" in data]
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False, pickle_module=module)
    except OffFastPath:
        raise
    except Exception as err:  # damaged, truncated…: weights_only gives the error its words
        raise OffFastPath(f"{type(err).__name__}") from err


# ---- DCP's .metadata ----------------------------------------------------------------------
#: torch's private names in DCP's .metadata, from the one module that lists them
_METADATA_SHIMS = {
    "torch.serialization._get_layout": _compat.torch_get_layout,
    names.STORAGE_INFO: _compat.DcpStorageInfo,
}


class SealedFunction:
    """An allowed function as ``find_class`` hands it over (``_get_layout``, whose ``__dict__``
    holds a cache every ``torch.load`` of a layout reads): calls it; a ``BUILD`` is refused."""

    __slots__ = ("_call", "name")

    def __init__(self, call: Callable[..., Any], name: str) -> None:
        self._call, self.name = call, name  # name: the allowed global's, module.name

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def __setstate__(self, state: Any) -> NoReturn:
        raise RewriteRefused(self.name)


class EnumMember:
    """A member of an allowed enum (DCP's ``_MEM_FORMAT_ENCODING``) as the unpickler sees it:
    members are shared and have a ``__dict__``, so a ``BUILD`` on one would change it for the
    process (its ``_value_``: every later DCP save would record another memory format). Equal
    to its member, all ``TensorProperties.__setstate__`` asks; a ``BUILD`` on it is refused."""

    __slots__ = ("member",)

    def __init__(self, member: enum.Enum) -> None:
        self.member = member

    def __eq__(self, other: object) -> bool:
        return other is self.member or (isinstance(other, EnumMember) and other.member is self.member)

    def __hash__(self) -> int:
        return hash(self.member)

    def __setstate__(self, state: Any) -> NoReturn:
        raise RewriteRefused(f"{type(self.member).__name__}.{self.member.name}")


def _sealed(found: Any, full: str) -> Any:
    """What ``find_class`` hands C pickle for the allowed ``full``: nothing a ``BUILD`` can
    change for the process (``None``: it is none of the kinds below, so it is not resolved)."""
    if isinstance(found, enum.EnumMeta):
        return SealedFunction(lambda value: EnumMember(found(value)), full)
    if isinstance(found, type):  # a static type (torch.Size, OrderedDict) cannot be set at all
        return found if found.__flags__ & _IMMUTABLE_TYPE else stand_in_class(found)
    if isinstance(found, types.FunctionType):
        return SealedFunction(found, full)
    return found if isinstance(found, torch.dtype) else None  # no __dict__, no __setstate__


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE (3.10+)


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    table = {}
    for full in names.METADATA_GLOBALS:
        found = _METADATA_SHIMS.get(full) or _resolve(full)
        sealed = _sealed(found, full) if found is not None else None
        if sealed is not None:
            table[_pair(full)] = sealed
    return table


def _metadata_global(module: str, name: str) -> Any:
    return _metadata_globals().get((module, name))


def unpickle_dcp_metadata(data: bytes, *, path: str) -> Any:
    """DCP's ``Metadata`` from ``.metadata`` bytes, through the restricted unpickler: DCP's
    metadata classes, ``torch.Size``, dtypes and layouts; nothing else. The unpickler never
    sees a class or function of torch's that a ``BUILD`` could change for the whole process
    (:func:`_sealed`): such a file is refused within the load, before anything is set."""
    return unpickle_metadata(data, path, _metadata_global)


def dcp_metadata(data: bytes, *, path: str, manifest: Manifest | None) -> Any:
    """:func:`unpickle_dcp_metadata`, checked to describe only tensors in byte ranges of the
    manifest's shard files (docs/security.md)."""
    metadata = unpickle_dcp_metadata(data, path=path)
    check_dcp_structure(metadata, path=path, manifest=manifest)
    return metadata


# ---- map_location -------------------------------------------------------------------------
def apply_map_location(obj: Any, map_location: Any) -> Any:
    """Move every tensor in ``obj`` (dicts, lists, tuples) where ``map_location`` (as
    ``torch.load`` takes it: device, str, dict or callable) sends a CPU storage."""
    if map_location is None:
        return obj
    device = _target_device(map_location)
    if device is None or device.type == "cpu":
        return obj
    return _map_tensors(obj, lambda t: t.to(device))


def _target_device(map_location: Any) -> torch.device | None:
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return torch.device(target) if target is not None else None
    if callable(map_location):
        probe = map_location(torch.UntypedStorage(0), "cpu")
        return probe.device if probe is not None else None
    return None


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor, containers kept as their exact types."""
    return map_leaves(obj, lambda leaf, _: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf)
