"""Reading pickles without running them and without torch: which globals they import, and
whether the loaders of format/unpickle.py would accept them.

Nothing here imports torch or NumPy, so the operator CLI's ``verify`` stays light:

* :func:`pickle_globals`, :func:`pickled_globals`: the globals a pickle names (opcode scan).
* :func:`check_state_pickle`: would ``load_state_bytes`` (``torch.load(weights_only=True)``
  with :data:`STATE_GLOBALS` allowed) accept this ``state-rankNNNNN.pt``? A replay of torch's
  weights-only unpickler: the same opcodes, the same rules, with inert stand-ins where torch
  builds objects. It raises the :class:`UntrustedCheckpointError` the load would raise.
* :func:`check_metadata_pickle`: DCP's ``.metadata`` through an unpickler whose
  ``find_class`` returns recording stand-ins for :data:`METADATA_GLOBALS` only, then
* :func:`check_dcp_structure`: the structural check, written once for real DCP objects
  (the load path) and stand-ins alike.

tests/unit/test_pickle_replay.py proves both agree with torch on real checkpoints, good and
crafted, and that every name allowed here is one the installed torch allows.
"""

from __future__ import annotations

import _compat_pickle
import importlib.metadata
import io
import pickle
import pickletools
import re
import struct
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

from lightning_preempt.errors import CheckpointError, CorruptCheckpointError, UntrustedCheckpointError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import SHARD_RE

TRUST_HINT = (
    "Load it only if you trust everyone who can write this storage: pass "
    "ShardedAsyncCheckpointIO(trust_checkpoints=True) (or Trainer.fit(..., weights_only=False) for one load, "
    "`lightning-preempt export --trust` on the command line). Better: keep plain types (dict, list, str, "
    "numbers, tensors, NumPy arrays) in on_save_checkpoint / hyper-parameters. See docs/security.md."
)
_STATE_CORRUPT_HINT = "The checkpoint is damaged or was not written by lightning_preempt; resume from an older one."
#: A ``data.pkl`` larger than this is refused unread (the loaders would need as much memory).
MAX_PICKLE_BYTES = 256 << 20


# ---- the allow-lists (qualified names; the guard tests compare them with torch's) -----------
def _names(template: str, parts: str) -> set[str]:
    return {template.format(p) for p in parts.split()}


_LEGACY = "Bool Byte Char Short Int Long Half Float Double BFloat16"
_SPARSE = "Byte Char Short Int Long Half Float Double BFloat16"
#: ``str(dtype)`` of every torch dtype (``torch.float32``; aliases such as ``float`` apart).
TORCH_DTYPES = frozenset(
    _names(
        "{}",
        "bool uint8 uint16 uint32 uint64 int8 int16 int32 int64 float16 float32 float64 bfloat16 complex32 "
        "complex64 complex128 qint8 quint8 qint32 quint4x2 quint2x4 bits1x8 bits2x4 bits4x2 bits8 bits16 "
        "float8_e5m2 float8_e4m3fn float8_e5m2fnuz float8_e4m3fnuz float8_e8m0fnu float4_e2m1fn_x2 uint1 uint2 "
        "uint3 uint4 uint5 uint6 uint7 int1 int2 int3 int4 int5 int6 int7",
    )
)
_DTYPE_ALIASES = frozenset(["float", "double", "half", "int", "long", "short", "cfloat", "cdouble", "chalf", "bit"])
_REBUILD = (
    "tensor tensor_v2 tensor_v3 parameter parameter_with_state qtensor sparse_tensor meta_tensor_no_storage "
    "nested_tensor wrapper_subclass device_tensor_from_numpy device_tensor_from_cpu_tensor"
)
#: What ``torch.load(weights_only=True)`` allows by default (torch 2.13).
TORCH_WEIGHTS_ONLY_GLOBALS = frozenset(
    {
        "_codecs.encode",
        "builtins.bytearray",
        "builtins.complex",
        "builtins.set",
        "collections.Counter",
        "collections.OrderedDict",
        "torch.Size",
        "torch.Tensor",
        "torch.device",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
        "torch._tensor._rebuild_from_type_v2",
        "torch.storage.TypedStorage",
        "torch.storage.UntypedStorage",
    }
    | {f"torch.{d}" for d in TORCH_DTYPES}
    | _names("torch._utils._rebuild_{}", _REBUILD)
    | _names("torch.{}Storage", _LEGACY + " ComplexFloat ComplexDouble QInt8 QUInt8 QInt32 QUInt4x2 QUInt2x4")
    | _names("torch.cuda.{}Storage", _LEGACY + " ComplexFloat ComplexDouble")
    | _names("torch.{}Tensor", _LEGACY)
    | _names("torch.cuda.{}Tensor", _LEGACY)
    | _names("torch.sparse.{}Tensor", _SPARSE)
    | _names("torch.cuda.sparse.{}Tensor", _SPARSE)
    | _names("torch.{}", "per_tensor_affine per_tensor_symmetric per_channel_affine per_channel_symmetric")
    | {"torch.per_channel_affine_float_qparams"}
)
#: ``np.dtype(t).str[1:]`` of the NumPy dtypes the skeleton allow-list admits (their classes).
NUMPY_DTYPE_CODES = frozenset(["b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"])
_NUMPY_DTYPE_CLASSES = "Bool Int8 Int16 Int32 Int64 UInt8 UInt16 UInt32 UInt64 Float16 Float32 Float64"


def _numpy_globals() -> frozenset[str]:
    """format/unpickle.py's NumPy names, for the installed NumPy, without importing it."""
    try:
        major = int(importlib.metadata.version("numpy").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return frozenset()
    core = "numpy._core" if major >= 2 else "numpy.core"
    return frozenset(
        {f"{core}.multiarray._reconstruct", f"{core}.multiarray.scalar", "numpy.ndarray", "numpy.dtype"}
        | _names("numpy.dtypes.{}DType", _NUMPY_DTYPE_CLASSES)
    )


#: Everything ``load_state_bytes`` lets a per-rank state file import.
STATE_GLOBALS = TORCH_WEIGHTS_ONLY_GLOBALS | {"lightning_preempt.format.TensorRef"} | _numpy_globals()
_MD = "torch.distributed.checkpoint.metadata."
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"
_METADATA_CLASSES = frozenset(
    {"torch.Size", _STORAGE_INFO}
    | _names(_MD + "{}", "Metadata TensorStorageMetadata ChunkStorageMetadata TensorProperties MetadataIndex")
    | _names(_MD + "{}", "StorageMeta _MEM_FORMAT_ENCODING")
)
#: Allowed functions, and the class of what they return.
_METADATA_FUNCTIONS = {"torch.serialization._get_layout": "torch.layout"}
#: Everything format/unpickle.py's ``_MetadataUnpickler`` resolves.
METADATA_GLOBALS = (
    _METADATA_CLASSES
    | set(_METADATA_FUNCTIONS)
    | {"collections.OrderedDict"}
    | {f"torch.{d}" for d in TORCH_DTYPES | _DTYPE_ALIASES}
)

# torch's weights-only unpickler renames these Python 2 globals first (torch._utils, taken
# from _compat_pickle; a guard test compares). torch.save writes protocol 2, which spells
# builtins the Python 2 way: every set or complex in a state is a __builtin__ global.
def _pair(dotted: str) -> tuple[str, str]:
    module, _, name = dotted.partition(".")
    return module, name


_PY2_MODULES = "__builtin__ copy_reg Queue repr _abcoll UserDict UserList UserString whichdb StringIO cStringIO"
_IMPORT_MAPPING = {k: _compat_pickle.IMPORT_MAPPING[k] for k in _names("{}", _PY2_MODULES)}
_NAME_MAPPING = {
    _pair(k): _compat_pickle.NAME_MAPPING[_pair(k)]
    for k in _names("__builtin__.{}", "xrange reduce intern unichr unicode long basestring")
    | _names("itertools.{}", "izip imap ifilter ifilterfalse izip_longest")
    | _names("{}", "UserDict.IterableUserDict UserDict.UserDict UserList.UserList UserString.UserString")
    | {"exceptions.StandardError"}
}
_BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})  # torch refuses them even when allowed


# ---- errors ----------------------------------------------------------------------------------
def untrusted_state_error(global_name: str | None, detail: str, path: str) -> UntrustedCheckpointError:
    """The error ``load_state_bytes`` raises for a state that needs more than the allow-list."""
    if global_name is not None:
        what = f"needs the global {global_name}, which is not on the allow-list of what lightning_preempt writes"
    else:
        what = f"uses something weights_only loading refuses ({detail})"
    return UntrustedCheckpointError(
        f"refusing to unpickle the checkpoint state: it {what}; unpickling it could run code",
        global_name=global_name,
        path=path,
        hint=TRUST_HINT,
    )


def _corrupt_state(detail: str, path: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"the per-rank state is not a readable torch.save file ({detail})", path=path, hint=_STATE_CORRUPT_HINT
    )


class _Refused(Exception):
    """What torch's weights-only unpickler refuses (it raises ``UnpicklingError`` there)."""

    def __init__(self, detail: str, global_name: str | None = None) -> None:
        super().__init__(detail)
        self.global_name = global_name


# ---- the per-rank state: a replay of torch.load(weights_only=True) ---------------------------
def check_state_pickle(data: bytes, *, path: str) -> None:
    """Raise what ``load_state_bytes(data, path=path)`` would raise, without torch.

    :class:`UntrustedCheckpointError` (naming the global, when one is to blame) for what
    the allow-list refuses; :class:`CorruptCheckpointError` when ``data`` is not a
    ``torch.save`` archive or its pickle does not hold together.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            prefix, info = _archive_pickle(archive, path)
            pkl = _record_bytes(archive, info, data)
            records = set(archive.namelist())
    except CheckpointError:
        raise
    except Exception as err:  # not a zip, a record failing its CRC, an unknown compression...
        raise _corrupt_state(f"not a readable zip archive: {type(err).__name__}: {str(err)[:200]}", path) from None
    try:
        _WeightsOnlyReplay(pkl, lambda key: f"{prefix}/data/{key}" in records).run()
    except _Refused as err:
        raise untrusted_state_error(err.global_name, str(err), path) from None
    except (ValueError, TypeError, KeyError, IndexError, EOFError) as err:
        raise _corrupt_state(f"{type(err).__name__}: {str(err)[:200]}", path) from None


def _archive_pickle(archive: zipfile.ZipFile, path: str) -> tuple[str, zipfile.ZipInfo]:
    """The archive's directory name and its ``data.pkl``, checked as torch's reader checks them."""
    names = archive.namelist()
    prefix = names[0].split("/", 1)[0] if names else ""
    if not names or any(not n.startswith(prefix + "/") for n in names):
        raise _corrupt_state("its records are not in one directory", path)
    if f"{prefix}/constants.pkl" in names:
        raise _corrupt_state("a TorchScript archive", path)
    order = archive.NameToInfo.get(f"{prefix}/byteorder")
    if order is not None and archive.read(order) not in (b"little", b"big"):
        raise _corrupt_state("unknown byte order", path)
    info = archive.NameToInfo.get(f"{prefix}/data.pkl")
    if info is None:
        raise _corrupt_state("no data.pkl", path)
    if info.file_size > MAX_PICKLE_BYTES:
        raise _corrupt_state(f"data.pkl holds {info.file_size} bytes", path)
    return prefix, info


def _record_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo, data: bytes) -> bytes:
    """A record's bytes as torch's reader takes them: a stored record (torch.save stores)
    is sliced out without zipfile's CRC-32 check, which torch does not make either (the
    manifest's CRC32C covers the whole file)."""
    if info.compress_type != zipfile.ZIP_STORED:
        return archive.read(info)
    header = data[info.header_offset : info.header_offset + 30]
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise ValueError(f"no local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > len(data):
        raise ValueError(f"{info.filename} runs past the end of the archive")
    return data[start : start + info.file_size]


class _Global:
    """An allowed global on the replay's stack (torch pushes the real class or function)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class _Made:
    """What calling an allowed torch or NumPy global returns (a tensor, an array, a Size...)."""

    def __init__(self, maker: str, args: Any) -> None:
        self.maker = maker
        self.args = args

    def buildable(self) -> bool:
        """Whether torch lets BUILD set its state: its type must be on the allow-list."""
        if self.maker == "numpy.dtype":  # np.dtype("<U3") is a StrDType, not allowed
            return bool(self.args) and self.args[0] in NUMPY_DTYPE_CODES
        return not self.maker.endswith((".scalar", "._get_layout"))

    def __repr__(self) -> str:
        return f"<{self.maker}(...)>"


# Allowed stdlib globals build the real (inert, empty) container, so type checks match torch's.
_STDLIB_RESULTS: dict[str, Callable[[], Any]] = {
    "collections.OrderedDict": OrderedDict,
    "collections.Counter": Counter,
    "builtins.set": set,
    "builtins.bytearray": bytearray,
    "builtins.complex": complex,
    "_codecs.encode": bytes,
}
_CONSTANTS = {"NONE": None, "NEWFALSE": False, "NEWTRUE": True, "EMPTY_TUPLE": ()}
_VALUES = frozenset({"BININT", "BININT1", "BININT2", "BINFLOAT", "LONG1", "BINUNICODE", "SHORT_BINSTRING"})


class _WeightsOnlyReplay:
    """torch's ``_weights_only_unpickler.Unpickler.load``, opcode for opcode (the same
    opcodes, the same refusals), pushing stand-ins where torch builds tensors and arrays."""

    def __init__(self, data: bytes, has_record: Callable[[str], bool]) -> None:
        self.data = data
        self.has_record = has_record
        self.metastack: list[list[Any]] = []
        self.stack: list[Any] = []
        self.memo: dict[int, Any] = {}

    def run(self) -> None:
        """Replay the pickle; raise :class:`_Refused` where torch raises ``UnpicklingError``."""
        try:
            for op, arg, _ in pickletools.genops(self.data):
                self.step(op.name, ord(op.code), arg)
                if op.name == "STOP":
                    return
        except ValueError as err:  # genops: an opcode byte pickle does not know, or truncated data
            unknown = re.search(r"at position (\d+), opcode .* unknown", str(err))
            if unknown is None:
                raise
            raise _Refused(f"Unsupported operand {self.data[int(unknown.group(1))]}") from None

    def step(self, name: str, code: int, arg: Any) -> None:
        if name in _CONSTANTS:
            self.stack.append(_CONSTANTS[name])
        elif name in _VALUES:
            self.stack.append(arg)
        else:
            handler = getattr(self, f"op_{name}", None)
            if handler is None:  # FRAME, MEMOIZE, STACK_GLOBAL...: torch.save writes protocol 2
                raise _Refused(f"Unsupported operand {code}")
            handler(arg)

    def pop_mark(self) -> list[Any]:
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    # -- risky operators
    def op_GLOBAL(self, arg: str) -> None:
        module, name = arg.split(" ", 1)
        module, name = _NAME_MAPPING.get((module, name), (_IMPORT_MAPPING.get(module, module), name))
        full = f"{module}.{name}"
        if module in _BLOCKED_MODULES:
            raise _Refused(f"Trying to load unsupported GLOBAL {full} whose module {module} is blocked.", full)
        if full not in STATE_GLOBALS:
            raise _Refused(f"Unsupported global: GLOBAL {full} was not an allowed global by default.", full)
        self.stack.append(_Global(full))

    def _call(self, refusal: str, func: Any, args: Any) -> Any:
        if not isinstance(func, _Global):
            raise _Refused(f"{refusal} {func!r}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"arguments are a {type(args).__name__}")
        make = _STDLIB_RESULTS.get(func.name)
        return make() if make is not None else _Made(func.name, tuple(args))

    def op_NEWOBJ(self, arg: None) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.stack.append(self._call("Can only create new object for classes allowlisted, but got", cls, args))

    def op_REDUCE(self, arg: None) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call("Trying to call reduce for unrecognized function", self.stack[-1], args)

    def op_BUILD(self, arg: None) -> None:
        self.stack.pop()
        inst = self.stack[-1]
        if not (type(inst) in (OrderedDict, Counter) or (isinstance(inst, _Made) and inst.buildable())):
            raise _Refused(f"Can only build Tensor, Parameter, OrderedDict or types allowlisted, but got {inst!r}")

    def op_BINPERSID(self, arg: None) -> None:
        pid: Any = self.stack.pop()
        kind = type(pid)
        if kind is not tuple and kind is not int:
            raise _Refused(f"persistent_load id must be tuple or int, but got {kind}")
        if kind is tuple and pid and pid[0] not in ("storage", b"storage"):
            raise _Refused(f"Only persistent_load of storage is allowed, but got {type(pid[0])}")
        # torch's persistent_load: ("storage", storage class, key, location, numel), record data/<key>
        ok = kind is tuple and len(pid) == 5 and isinstance(pid[1], _Global) and isinstance(pid[2], str)
        if not ok or not pid[1].name.endswith("Storage") or type(pid[4]) is not int or not self.has_record(pid[2]):
            raise KeyError(f"persistent id {pid!r} names no storage record of the archive")
        self.stack.append(_Made(pid[1].name, pid))

    # -- containers
    def op_APPEND(self, arg: None) -> None:
        item = self.stack.pop()
        self._target((list,), "append to lists").append(item)

    def op_APPENDS(self, arg: None) -> None:
        items = self.pop_mark()
        self._target((list,), "extend lists").extend(items)

    def op_SETITEM(self, arg: None) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._target((dict, OrderedDict, Counter), "SETITEM for dict")[key] = value

    def op_SETITEMS(self, arg: None) -> None:
        items = self.pop_mark()
        target = self._target((dict, OrderedDict, Counter), "SETITEMS for dict")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _target(self, kinds: tuple[type, ...], what: str) -> Any:
        target = self.stack[-1]
        if type(target) not in kinds:
            raise _Refused(f"Can only {what}, but got {type(target)}")
        return target

    def op_MARK(self, arg: None) -> None:
        self.metastack.append(self.stack)
        self.stack = []

    def op_TUPLE(self, arg: None) -> None:
        items = self.pop_mark()  # first: it replaces self.stack
        self.stack.append(tuple(items))

    def op_TUPLE1(self, arg: None) -> None:
        self.stack[-1] = (self.stack[-1],)

    def op_TUPLE2(self, arg: None) -> None:
        self.stack[-2:] = [(self.stack[-2], self.stack[-1])]

    def op_TUPLE3(self, arg: None) -> None:
        self.stack[-3:] = [(self.stack[-3], self.stack[-2], self.stack[-1])]

    def op_EMPTY_LIST(self, arg: None) -> None:
        self.stack.append([])

    def op_EMPTY_DICT(self, arg: None) -> None:
        self.stack.append({})

    def op_EMPTY_SET(self, arg: None) -> None:
        self.stack.append(set())

    # -- memo
    def op_BINPUT(self, arg: int) -> None:
        self.memo[arg] = self.stack[-1]

    def op_BINGET(self, arg: int) -> None:
        self.stack.append(self.memo[arg])

    op_LONG_BINPUT, op_LONG_BINGET = op_BINPUT, op_BINGET

    def op_PROTO(self, arg: int) -> None:
        pass  # torch only warns about a protocol other than 2

    def op_STOP(self, arg: None) -> None:
        self.stack.pop()


# ---- DCP's .metadata: a stub unpickler, then the structure ------------------------------------
class _Stub:
    """An object of an allowed DCP class: records its arguments and state; runs nothing."""

    qualified: ClassVar[str] = ""

    def __new__(cls, *args: Any) -> _Stub:
        obj = super().__new__(cls)
        obj.__dict__["_lp_args"] = args
        return obj

    def __init__(self, *args: Any) -> None:
        pass

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

    def __init__(self, returns: str) -> None:
        self.result = _stub_class(returns)

    def __call__(self, *args: Any) -> _Stub:
        return self.result(*args)


class _StubValue:
    """An allowed value (a dtype such as ``torch.float32``): neither callable nor a class."""

    def __init__(self, qualified: str) -> None:
        self.qualified = qualified


_STUB_CLASSES: dict[str, type[_Stub]] = {}


def _stub_class(qualified: str) -> type[_Stub]:
    if qualified not in _STUB_CLASSES:
        _STUB_CLASSES[qualified] = type(qualified.rsplit(".", 1)[-1], (_Stub,), {"qualified": qualified})
    return _STUB_CLASSES[qualified]


class _MetadataStubUnpickler(pickle.Unpickler):
    """format/unpickle.py's ``_MetadataUnpickler`` with stand-ins in place of torch's classes."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full == "collections.OrderedDict":
            return OrderedDict  # the loader uses the real one too
        if full in _METADATA_FUNCTIONS:
            return _StubFunction(_METADATA_FUNCTIONS[full])
        if full in _METADATA_CLASSES:
            return _stub_class(full)
        if full in METADATA_GLOBALS:
            return _StubValue(full)
        raise metadata_global_error(module, name, self._path)

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


def check_metadata_pickle(data: bytes, *, path: str, manifest: Manifest | None) -> None:
    """Raise what reading and checking DCP's ``.metadata`` (``read_dcp_metadata``) would raise."""
    try:
        metadata = _MetadataStubUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as err:  # truncated, garbage, a class called the wrong way...
        raise CorruptCheckpointError(
            f"DCP's .metadata cannot be read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
            path=path,
            hint="The checkpoint is damaged; resume from an older one.",
        ) from err
    check_dcp_structure(metadata, path=path, manifest=manifest)


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

    if qualified_type(metadata) != _MD + "Metadata":
        raise bad(f"it holds a {short(metadata)}, not DCP Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise bad("state_dict_metadata is not a mapping of names")
    for fqn, entry in entries.items():
        if qualified_type(entry) != _MD + "TensorStorageMetadata":
            raise bad(f"{fqn!r} is a {short(entry)}, not a tensor")
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise bad("storage_data is not a mapping")
    for index, info in storage.items():
        if qualified_type(index) != _MD + "MetadataIndex" or qualified_type(info) != _STORAGE_INFO:
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


# ---- which globals a pickle names ---------------------------------------------------------------
def pickled_globals(path: str) -> set[str]:
    """Every ``module.qualname`` the pickle inside the ``torch.save`` file at ``path`` imports."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        data = archive.read(names[0])
    return pickle_globals(data)


def pickle_globals(data: bytes) -> set[str]:
    """Every ``module.qualname`` a pickle imports (``GLOBAL`` and ``STACK_GLOBAL``)."""
    found: set[str] = set()
    memo: dict[Any, Any] = {}
    recent: list[Any] = []  # what each op pushed, as far as strings go
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "GLOBAL":
            module, qualname = str(arg).split(" ", 1)
            found.add(f"{module}.{qualname}")
            recent.append(None)
        elif name == "STACK_GLOBAL":
            if len(recent) >= 2 and isinstance(recent[-2], str) and isinstance(recent[-1], str):
                found.add(f"{recent[-2]}.{recent[-1]}")
            else:
                found.add("<unknown>.<unknown>")
            recent.append(None)
        elif "UNICODE" in name or "STRING" in name:
            recent.append(arg)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = recent[-1] if recent else None
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            recent.append(memo.get(arg))
        else:
            recent.append(None)
    return found
