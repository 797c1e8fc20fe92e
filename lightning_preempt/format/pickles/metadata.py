"""DCP's ``.metadata`` through the restricted unpickler (docs/security.md): C pickle whose
``find_class`` resolves the names of allowlists.METADATA_GLOBALS only, then one structural
check (:func:`check_dcp_structure`). The load resolves them to sealed stand-ins that make
torch's objects (unpickle.py's ``dcp_metadata``); ``verify`` to recording stand-ins
(:func:`check_metadata_pickle`), without torch.

Whatever ``find_class`` returns is shared by every load of the process, and C pickle's
``BUILD`` sets the state of whatever is on its stack: on a Python class, with a slot state,
an attribute of the class for every thread at once. So no class of torch's is ever on that
stack: the classes handed out are :class:`Sealed`, whose ``__setstate__`` (``BUILD`` asks
for it first) refuses, within the load, before anything is set.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn, cast

from lightning_preempt.errors import CheckpointError, CorruptCheckpointError, UntrustedCheckpointError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import SHARD_RE
from lightning_preempt.format.pickles.allowlists import (
    DCP_MD,
    METADATA_CLASSES,
    METADATA_FUNCTIONS,
    METADATA_GLOBALS,
    STORAGE_INFO,
)


class RewriteRefused(Exception):
    """A ``BUILD`` on something ``find_class`` returned (its args: that thing's name)."""


def _refuse(name: str) -> Callable[..., NoReturn]:
    def refuse(*_: Any) -> NoReturn:
        raise RewriteRefused(name)

    return refuse


class Sealed(type):
    """The metaclass of every class ``find_class`` hands C pickle. ``BUILD`` on an object
    asks it for ``__setstate__`` first and calls that alone; on a class the lookup meets this
    data descriptor before anything of the class, and it refuses. Nothing may set or delete
    their attributes either."""

    @property
    def __setstate__(cls) -> Callable[..., NoReturn]:
        return _refuse(cls.__name__)

    def __setattr__(cls, name: str, value: Any) -> None:
        raise RewriteRefused(cls.__name__)

    def __delattr__(cls, name: str) -> None:
        raise RewriteRefused(cls.__name__)


class _MakesReal(Sealed):
    """:func:`stand_in_class`'s metaclass: calling a stand-in calls its class (``REDUCE``)."""

    _lp_real: type

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._lp_real(*args, **kwargs)


def stand_in_class(real: type) -> type:
    """What ``find_class`` returns for ``real``, a class defined in Python: calling it
    (``REDUCE``) and its ``__new__`` (``NEWOBJ``, what a dataclass pickles to) make ``real``'s
    objects exactly as ``real`` would, so a load's objects are ``real``'s own; ``real`` itself
    never reaches the unpickler, and a ``BUILD`` on the stand-in is refused (:class:`Sealed`)."""

    def __new__(_: type, *args: Any, **kwargs: Any) -> Any:
        return real.__new__(real, *args, **kwargs)

    new: Any = __new__
    if real.__new__ is object.__new__ and real.__init__ is not object.__init__:  # type: ignore[misc]
        # (every DCP dataclass) the same in C (a Python __new__ costs ~0.3 us per object, ~7 ms per 4000-tensor
        # .metadata): object.__new__(real, stand_in, *args) ignores all but real, as it
        # ignores the args of a class with an __init__ of its own
        new = staticmethod(functools.partial(object.__new__, real))
    namespace = {"__new__": new, "_lp_real": real, "__module__": real.__module__, "__qualname__": real.__qualname__}
    return _MakesReal(real.__name__, (), namespace)


class _Stub:
    """An object of an allowed DCP class: records its arguments and state; runs nothing."""

    qualified: ClassVar[str] = ""

    def __new__(cls, *args: Any) -> _Stub:
        obj = super().__new__(cls)
        obj.__dict__["_lp_args"] = args
        return obj

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state, slots = state
            self.__dict__.update({k: v for k, v in slots.items() if isinstance(k, str)})
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})
        elif state is not None:
            self.__dict__["_lp_state"] = state


class _StubFunction:
    """An allowed function (``_get_layout``): calling it records a stand-in result."""

    def __init__(self, qualified: str, returns: str) -> None:
        self.qualified = qualified
        self.result = _stub_class(returns)

    def __call__(self, *args: Any) -> _Stub:
        return self.result(*args)

    def __setstate__(self, state: Any) -> NoReturn:  # as the load's (unpickle.py's SealedFunction)
        raise RewriteRefused(self.qualified)


class _StubValue:
    """An allowed value (a dtype such as ``torch.float32``): neither callable nor a class."""

    def __init__(self, qualified: str) -> None:
        self.qualified = qualified

    def __setstate__(self, state: Any) -> NoReturn:  # the load's dtypes take no state either
        raise RewriteRefused(self.qualified)


_STUB_CLASSES: dict[str, type[_Stub]] = {}


def _stub_class(qualified: str) -> type[_Stub]:
    if qualified not in _STUB_CLASSES:  # shared by every verify: sealed as the load's
        made = Sealed(qualified.rsplit(".", 1)[-1], (_Stub,), {"qualified": qualified})
        _STUB_CLASSES[qualified] = cast("type[_Stub]", made)
    return _STUB_CLASSES[qualified]


def _stand_in(module: str, name: str) -> Any:
    """The stand-in for an allowed global (``None``: not allowed)."""
    full = f"{module}.{name}"
    if full == "collections.OrderedDict":
        return OrderedDict  # the loader uses the real one too
    if full in METADATA_FUNCTIONS:
        return _StubFunction(full, METADATA_FUNCTIONS[full])
    if full in METADATA_CLASSES:
        return _stub_class(full)
    return _StubValue(full) if full in METADATA_GLOBALS else None


class MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` unpickler: ``resolve(module, name)`` gives an allowed global or
    ``None`` (real classes in format/pickles/unpickle.py, stand-ins here); nothing else."""

    def __init__(self, file: Any, path: str, resolve: Callable[[str, str], Any]) -> None:
        super().__init__(file)
        self._path = path
        self._resolve = resolve

    def find_class(self, module: str, name: str) -> Any:
        found = self._resolve(module, name)
        if found is None:
            raise metadata_global_error(module, name, self._path)
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CorruptCheckpointError("DCP metadata uses persistent ids", path=self._path)


def metadata_global_error(module: str, name: str, path: str) -> CheckpointError:
    """What reading DCP's ``.metadata`` raises for a global outside its allow-list."""
    if name == "BytesStorageMetadata":
        return CorruptCheckpointError(
            "DCP metadata declares byte-IO (pickled object) items; lightning_preempt writes tensors only",
            path=path,
            hint="This checkpoint was not written by lightning_preempt or was tampered with; do not load it.",
        )
    return UntrustedCheckpointError(
        f"refusing to unpickle DCP's .metadata: it needs the global {module}.{name}, not one of DCP's "
        "metadata classes; unpickling it could run code",
        global_name=f"{module}.{name}",
        path=path,
        hint="lightning_preempt never writes that: the checkpoint was tampered with or written by something "
        "else. trust_checkpoints does not cover DCP metadata; delete the checkpoint (docs/security.md).",
    )


def unpickle_metadata(data: bytes, path: str, resolve: Callable[[str, str], Any]) -> Any:
    """``.metadata``'s object through :class:`MetadataUnpickler`; damage raises :class:`CorruptCheckpointError`."""
    try:
        return MetadataUnpickler(io.BytesIO(data), path, resolve).load()
    except CheckpointError:
        raise
    except RewriteRefused as err:
        raise CorruptCheckpointError(
            f"DCP's .metadata is not what lightning_preempt writes: it sets attributes of {err}",
            path=path,
            hint="The checkpoint was tampered with; resume from an older one (nothing was changed).",
        ) from None
    except Exception as err:  # truncated, garbage, a class called the wrong way...
        raise CorruptCheckpointError(
            f"DCP's .metadata cannot be read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
            path=path,
            hint="The checkpoint is damaged; resume from an older one.",
        ) from err


def check_metadata_pickle(data: bytes, *, path: str, manifest: Manifest | None) -> None:
    """Raise what reading and checking DCP's ``.metadata`` (``dcp_metadata``) would raise."""
    check_dcp_structure(unpickle_metadata(data, path, _stand_in), path=path, manifest=manifest)


def qualified_type(obj: Any) -> str:
    """``module.qualname`` of ``obj``'s class; for a stand-in, of the class it stands for."""
    if isinstance(obj, (_Stub, _StubValue)):
        return obj.qualified
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_dcp_structure(metadata: Any, *, path: str, manifest: Manifest | None) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``metadata`` (real DCP objects or
    stand-ins) describes only tensors stored in byte ranges of our shard files (listed in
    ``manifest``, when given), with no stream transforms."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"DCP's .metadata is not what lightning_preempt writes: {why}",
            path=path,
            hint="The checkpoint is damaged or was tampered with; resume from an older one.",
        )

    def short(obj: Any) -> str:
        return qualified_type(obj).rsplit(".", 1)[-1]

    if qualified_type(metadata) != DCP_MD + "Metadata":
        raise bad(f"it holds a {short(metadata)}, not DCP Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise bad("state_dict_metadata is not a mapping of names")
    for fqn, entry in entries.items():
        if qualified_type(entry) != DCP_MD + "TensorStorageMetadata":
            raise bad(f"{fqn!r} is a {short(entry)}, not a tensor")
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise bad("storage_data is not a mapping")
    for index, info in storage.items():
        if qualified_type(index) != DCP_MD + "MetadataIndex" or qualified_type(info) != STORAGE_INFO:
            raise bad("storage_data holds something other than DCP storage records")
        _check_record(info, manifest, bad)


def _check_record(info: Any, manifest: Manifest | None, bad: Callable[[str], CorruptCheckpointError]) -> None:
    name, offset, length = info.relative_path, getattr(info, "offset", None), getattr(info, "length", None)
    if not isinstance(name, str) or not SHARD_RE.fullmatch(name):
        raise bad(f"a tensor is stored in {name!r}, not in one of our shard files")
    if not _is_nonneg_int(offset) or not _is_nonneg_int(length):
        raise bad(f"a byte range in {name!r} is not a pair of non-negative integers")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        raise bad(f"a record in {name!r} needs stream transforms {list(transforms)!r}")
    if manifest is not None:
        entry = manifest.files.get(name)
        if entry is None:
            raise bad(f"{name!r} is not listed in the manifest")
        assert isinstance(offset, int) and isinstance(length, int)  # checked above
        if offset + length > entry.size:
            raise bad(f"a record lies beyond the end of {name!r}")


def _is_nonneg_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
