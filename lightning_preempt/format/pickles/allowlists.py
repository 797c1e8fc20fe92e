"""The loaders' allow-lists as qualified names, for the torch-free checks (state_replay,
metadata_scan), so ``verify`` needs neither torch nor NumPy. Guard tests
(tests/unit/test_pickle_replay.py) require each to equal what installed torch/NumPy allow.
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
#: ``np.dtype(t).str[1:]`` of the NumPy dtypes the skeleton allow-list admits (their classes).
NUMPY_DTYPE_CODES = frozenset(["b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8"])
_NUMPY_DTYPE_CLASSES = "Bool Int8 Int16 Int32 Int64 UInt8 UInt16 UInt32 UInt64 Float16 Float32 Float64"


def _numpy_globals() -> frozenset[str]:
    """format/pickles/unpickle.py's NumPy names, for the installed NumPy, without importing it."""
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
STATE_GLOBALS = (
    TORCH_WEIGHTS_ONLY_GLOBALS
    | {"lightning_preempt.format.TensorRef", "lightning_preempt.format.TensorDict",
       "lightning_preempt.format.tensor_from_bytes"}
    | _numpy_globals()
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
