"""Every allow-list of the package, spelled once, as qualified names (``module.name``): the
opcode check (check.py) reads the names, the loaders (unpickle.py, metadata.py) resolve them
to objects. No torch here: ``verify`` needs neither torch nor NumPy. The guard tests
(tests/unit/test_pickle_replay.py) pin the copies of torch's own lists to installed torch.
"""

from __future__ import annotations

import _compat_pickle
import importlib.metadata


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
#: The NumPy dtypes a state may hold (exact-resume RNG states): ``np.dtype(t).str[1:]`` -> class name.
NUMPY_DTYPES = {"b1": "Bool", "i1": "Int8", "i2": "Int16", "i4": "Int32", "i8": "Int64", "u1": "UInt8",
                "u2": "UInt16", "u4": "UInt32", "u8": "UInt64", "f2": "Float16", "f4": "Float32", "f8": "Float64"}  # fmt: skip


def _numpy_core() -> str | None:
    """Where the installed NumPy keeps ``multiarray`` (it moved in 2.0), without importing it."""
    try:
        major = int(importlib.metadata.version("numpy").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):  # pragma: no cover - torch brings NumPy
        return None
    return "numpy._core" if major >= 2 else "numpy.core"


_CORE = _numpy_core()
_RECONSTRUCT = f"{_CORE}.multiarray._reconstruct"
#: NumPy's array and scalar reconstruction and the dtypes above (a NumPy 1.x pickle loaded
#: under NumPy 2 names numpy.core.*: refused, named in the error).
NUMPY_GLOBALS = frozenset(
    {_RECONSTRUCT, f"{_CORE}.multiarray.scalar", "numpy.ndarray", "numpy.dtype"}
    | {f"numpy.dtypes.{c}DType" for c in NUMPY_DTYPES.values()}
    if _CORE
    else ()
)
#: What the skeleton's own pickles name (format/__init__.py).
OURS = frozenset({"lightning_preempt.format.TensorRef", "lightning_preempt.format.TensorDict",
                  "lightning_preempt.format.tensor_from_bytes"})  # fmt: skip
#: Everything ``load_state_bytes`` lets a per-rank state file import: on top of torch's
#: ``weights_only`` defaults, the placeholders, inline tensors and NumPy.
STATE_GLOBALS = TORCH_WEIGHTS_ONLY_GLOBALS | OURS | NUMPY_GLOBALS

# The fast road (unpickle.py): C pickle resolves this subset, after the opcode check with
# these stricter rules; anything else goes to the weights-only loader.
_LEGACY_STORAGES = _names(
    "torch.{}Storage", _LEGACY + " ComplexFloat ComplexDouble QInt8 QUInt8 QInt32 QUInt4x2 QUInt2x4"
)
_FAST_CALLS = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch.Size", "torch.device",
               "_codecs.encode", "numpy.dtype", _RECONSTRUCT} | OURS  # fmt: skip
#: Allowed callables of the fast road (``_codecs.encode``: how protocol 2 pickles bytes).
FAST_CALLABLES = frozenset(_FAST_CALLS if _CORE else _FAST_CALLS - {"numpy.dtype", _RECONSTRUCT})
#: Globals the fast road resolves: its callables, dtypes, ``numpy.ndarray`` (only an argument
#: of ``_reconstruct``: never called, ``np.ndarray(shape)`` allocates) and the legacy
#: storage types of ``torch.save``'s persistent ids (torch's own ``find_class`` resolves those).
FAST_GLOBALS = FAST_CALLABLES | {f"torch.{d}" for d in TORCH_DTYPES} | ({"numpy.ndarray"} if _CORE else set())
FAST_NAMES = FAST_GLOBALS | _LEGACY_STORAGES
#: What BUILD may set the state of on the fast road (OrderedDict: a dict state only).
FAST_BUILDABLE = frozenset({"collections.OrderedDict", "lightning_preempt.format.TensorRef"}) | (
    FAST_CALLABLES & {"numpy.dtype", _RECONSTRUCT}
)
#: The module of DCP's metadata classes, with the dot: ``DCP_MD + "Metadata"``.
DCP_MD = "torch.distributed.checkpoint.metadata."
#: The class of a ``storage_data`` value (where a tensor's bytes lie).
STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"
#: The classes DCP's ``.metadata`` may build.
METADATA_CLASSES = frozenset(
    {"torch.Size", STORAGE_INFO}
    | _names(DCP_MD + "{}", "Metadata TensorStorageMetadata ChunkStorageMetadata TensorProperties MetadataIndex")
    | _names(DCP_MD + "{}", "StorageMeta _MEM_FORMAT_ENCODING")
)
#: Allowed functions, and the class of what they return.
METADATA_FUNCTIONS = {"torch.serialization._get_layout": "torch.layout"}
#: Everything format/pickles/unpickle.py's ``unpickle_dcp_metadata`` resolves.
METADATA_GLOBALS = (
    METADATA_CLASSES
    | set(METADATA_FUNCTIONS)
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
BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})  # torch refuses them even when allowed


def py2_rename(module: str, name: str) -> tuple[str, str]:
    """``module``, ``name`` of a ``GLOBAL`` as torch's weights-only unpickler resolves it."""
    return _NAME_MAPPING.get((module, name), (_IMPORT_MAPPING.get(module, module), name))
