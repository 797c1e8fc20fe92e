"""The opcode check of a state file's pickle, without torch (docs/security.md).

``data.pkl`` is walked opcode by opcode under the rules of torch's weights-only unpickler,
with inert stand-ins where torch builds tensors and arrays. With :data:`WEIGHTS_ONLY` it
raises what ``load_state_bytes`` would (:func:`check_state_pickle`, for ``verify``;
tests/unit/test_pickle_replay.py runs both on the same bytes); with :data:`FAST` (a subset,
stricter) it is the guard before C pickle loads the common case (unpickle.py).
"""

from __future__ import annotations

import dataclasses
import io
import struct
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from lightning_preempt.errors import CheckpointError, CorruptCheckpointError, UntrustedCheckpointError
from lightning_preempt.format.pickles import allowlists as names
from lightning_preempt.format.pickles.zip_layout import AmbiguousArchive, check_one_reading

TRUST_HINT = (
    "Load it only if you trust everyone who can write this storage: pass "
    "ShardedAsyncCheckpointIO(trust_checkpoints=True) (or Trainer.fit(..., weights_only=False) for one load, "
    "`lightning-preempt export --trust` on the command line). Better: keep plain types (dict, list, str, "
    "numbers, tensors, NumPy arrays) in on_save_checkpoint / hyper-parameters. See docs/security.md."
)
_STATE_CORRUPT_HINT = "The checkpoint is damaged or was not written by lightning_preempt; resume from an older one."
#: A ``data.pkl`` larger than this is refused unread (the loaders would need as much memory).
MAX_PICKLE_BYTES = 256 << 20


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


def corrupt_state_error(detail: str, path: str) -> CorruptCheckpointError:
    """The error ``load_state_bytes`` raises for a state file that is not readable."""
    return CorruptCheckpointError(
        f"the per-rank state is not a readable torch.save file ({detail})", path=path, hint=_STATE_CORRUPT_HINT
    )


class Refused(Exception):
    """What the rules refuse (torch's weights-only unpickler raises ``UnpicklingError`` there)."""

    def __init__(self, detail: str, global_name: str | None = None) -> None:
        super().__init__(detail)
        self.global_name = global_name


# ---- the archive -------------------------------------------------------------------------------
def archived_pickle(data: bytes, path: str = "") -> tuple[bytes, Callable[[str], bool]]:
    """The ``data.pkl`` bytes of a ``torch.save`` archive and whether it holds a storage
    record of a given key; refuses an archive two zip readers could read differently
    (zip_layout.py) or one torch's reader would not take."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        try:
            check_one_reading(data, archive)
        except AmbiguousArchive as err:
            raise corrupt_state_error(f"not laid out as torch.save writes: {err}", path) from None
        records = archive.NameToInfo
        prefix = next(iter(records), "").split("/", 1)[0]
        if not records or any(not n.startswith(prefix + "/") for n in records):
            raise corrupt_state_error("its records are not in one directory", path)
        if f"{prefix}/constants.pkl" in records:
            raise corrupt_state_error("a TorchScript archive", path)
        order = records.get(f"{prefix}/byteorder")
        if order is not None and archive.read(order) not in (b"little", b"big"):
            raise corrupt_state_error("unknown byte order", path)
        info = records.get(f"{prefix}/data.pkl")
        if info is None:
            raise corrupt_state_error("no data.pkl", path)
        if info.file_size > MAX_PICKLE_BYTES:
            raise corrupt_state_error(f"data.pkl holds {info.file_size} bytes", path)
        has_record = set(records).__contains__
        return _record_bytes(archive, info, data), lambda key: has_record(f"{prefix}/data/{key}")


def _record_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo, data: bytes) -> bytes:
    """A record's bytes as torch's reader takes them: a stored record (torch.save stores)
    is sliced out without zipfile's CRC-32 check, which torch does not make either (the
    manifest's CRC32C covers the whole file)."""
    if info.compress_type != zipfile.ZIP_STORED:
        return archive.read(info)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len  # (zip_layout checked the local header)
    if start + info.file_size > len(data):
        raise ValueError(f"{info.filename} runs past the end of the archive")
    return data[start : start + info.file_size]


def check_state_pickle(data: bytes, *, path: str) -> None:
    """Raise what ``load_state_bytes(data, path=path)`` would raise, without torch."""
    try:
        pkl, has_record = archived_pickle(data, path)
    except CheckpointError:
        raise
    except Exception as err:  # not a zip, a record failing its CRC, an unknown compression...
        raise corrupt_state_error(f"not a readable zip archive: {type(err).__name__}: {str(err)[:200]}", path) from None
    try:
        walk(pkl, WEIGHTS_ONLY, has_record)
    except Refused as err:
        raise untrusted_state_error(err.global_name, str(err), path) from None
    except (ValueError, TypeError, KeyError, IndexError, EOFError, struct.error, RecursionError) as err:
        raise corrupt_state_error(f"{type(err).__name__}: {str(err)[:200]}", path) from None


# ---- the rules ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rules:
    """What a walk allows. ``callables``/``buildable`` ``None``: torch's weights-only rule."""

    globals: frozenset[str]
    callables: frozenset[str] | None = None
    buildable: frozenset[str] | None = None
    #: C pickle's bounds: memo indices dense (it sizes its memo by the largest), BUILD on an
    #: OrderedDict with a dict state only (slot state would set attributes), REDUCE/NEWOBJ
    #: arguments a tuple, one value at STOP and nothing after it
    strict: bool = False


#: What ``load_state_bytes`` accepts (torch's ``weights_only`` with this package's allow-list).
WEIGHTS_ONLY = Rules(names.STATE_GLOBALS)
#: What the fast road lets C pickle run.
FAST = Rules(names.FAST_NAMES, names.FAST_CALLABLES, names.FAST_BUILDABLE, strict=True)


class _Global:
    """An allowed global on the walked stack (torch pushes the real class or function)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


class _Made:
    """What calling an allowed torch or NumPy global returns (a tensor, an array, a Size...)."""

    __slots__ = ("args", "maker")

    def __init__(self, maker: str, args: Any) -> None:
        self.maker = maker
        self.args = args

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


def _what(value: Any) -> str:
    """How an error names a stack value (never its repr: a crafted one can be deeply nested)."""
    return repr(value) if isinstance(value, (_Global, _Made)) else type(value).__name__


def _buildable(inst: Any, state: Any, rules: Rules) -> bool:
    if type(inst) is OrderedDict or type(inst) is Counter:  # torch: inst.__dict__.update(state)...
        if type(inst) is OrderedDict and type(state) is not dict:  # ...which a slot state fails
            if rules.strict:
                return False
            raise TypeError("BUILD on an OrderedDict with a state that is not a dict")
        return rules.buildable is None or type(inst) is OrderedDict
    if not isinstance(inst, _Made):
        return False
    if rules.buildable is not None:
        return inst.maker in rules.buildable
    if inst.maker == "numpy.dtype":  # np.dtype("<U3") is a StrDType, not allowed
        return bool(inst.args) and inst.args[0] in names.NUMPY_DTYPES
    return not inst.maker.endswith((".scalar", "._get_layout"))


def _call(func: Any, args: Any, rules: Rules, refusal: str) -> Any:
    if type(func) is not _Global or (rules.callables is not None and func.name not in rules.callables):
        raise Refused(f"{refusal} {_what(func)}")
    if type(args) is not tuple and (rules.strict or not isinstance(args, list)):
        raise TypeError(f"arguments are a {type(args).__name__}")
    make = _STDLIB_RESULTS.get(func.name)
    return make() if make is not None else _Made(func.name, tuple(args))


_CONSTANTS = {0x4E: None, 0x89: False, 0x88: True}  # NONE, NEWFALSE, NEWTRUE
_EMPTY: dict[int, Callable[[], Any]] = {0x29: tuple, 0x5D: list, 0x8F: set}  # EMPTY_TUPLE, _LIST, _SET
_FIXED = {0x4A: struct.Struct("<i"), 0x47: struct.Struct(">d")}  # BININT, BINFLOAT
_U32 = struct.Struct("<I").unpack_from


# One dispatch loop, its branches ordered by how often a skeleton holds each opcode (memo
# gets of shared keys and references first); the opcodes are those torch's weights-only
# unpickler reads (protocol 2), the rest refused as it refuses them.
def walk(pkl: bytes, rules: Rules, has_record: Callable[[str], bool]) -> None:
    """Walk ``pkl`` under ``rules``; raise :class:`Refused` where the rules (or torch) refuse,
    and what torch raises for a broken pickle (``IndexError``, ``KeyError``...)."""
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    memo: dict[int, Any] = {}
    pos, end, strict = 0, len(pkl), rules.strict
    fresh = 0  # the lowest memo index not used yet
    # what REDUCE makes a stand-in of without more checks (the stdlib's make real containers)
    callables = (rules.callables if rules.callables is not None else rules.globals) - _STDLIB_RESULTS.keys()
    while True:
        if pos >= end:
            raise EOFError("no STOP")
        op = pkl[pos]
        pos += 1
        if op == 0x68:  # BINGET
            stack.append(memo[pkl[pos]])
            pos += 1
        elif op == 0x72 or op == 0x71:  # BINPUT, LONG_BINPUT
            if op == 0x71:
                idx, pos = pkl[pos], pos + 1
            else:
                idx, pos = _U32(pkl, pos)[0], pos + 4
            if idx >= fresh:
                if strict and idx > fresh:  # C pickle sizes its memo array by the largest index
                    raise Refused(f"memo index {idx} after {fresh} values")
                fresh = idx + 1
            memo[idx] = stack[-1]
        elif op == 0x58:  # BINUNICODE
            n = _U32(pkl, pos)[0]
            if pos + 4 + n > end:
                raise EOFError("truncated string")
            stack.append(str(pkl[pos + 4 : pos + 4 + n], "utf-8", "surrogatepass"))
            pos += 4 + n
        elif op == 0x4D:  # BININT2
            stack.append(pkl[pos] | pkl[pos + 1] << 8)
            pos += 2
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            func = stack[-1]
            if type(func) is _Global and type(args) is tuple and func.name in callables:
                stack[-1] = _Made(func.name, args)
            else:
                stack[-1] = _call(func, args, rules, "REDUCE of")
        elif op == 0x28:  # MARK
            metastack.append(stack)
            stack = []
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x75:  # SETITEMS
            items, stack = stack, metastack.pop()
            target = stack[-1]
            if type(target) is not dict and type(target) is not OrderedDict and type(target) is not Counter:
                raise Refused(f"SETITEMS on something other than a dict: {_what(target)}")
            if len(items) % 2:
                raise IndexError("list index out of range")  # as torch's items[i + 1] raises
            target.update(zip(items[::2], items[1::2]))
        elif op == 0x4B:  # BININT1
            stack.append(pkl[pos])
            pos += 1
        elif op == 0x6A:  # LONG_BINGET
            stack.append(memo[_U32(pkl, pos)[0]])
            pos += 4
        elif op == 0x81:  # NEWOBJ
            args = stack.pop()
            stack.append(_call(stack.pop(), args, rules, "NEWOBJ of"))
        elif op == 0x73:  # SETITEM
            value, key = stack.pop(), stack.pop()
            target = stack[-1]
            if type(target) is not dict and type(target) is not OrderedDict and type(target) is not Counter:
                raise Refused(f"SETITEM on something other than a dict: {_what(target)}")
            target[key] = value
        elif op == 0x61 or op == 0x65:  # APPEND, APPENDS
            if op == 0x61:
                items = [stack.pop()]
            else:
                items, stack = stack, metastack.pop()
            if type(stack[-1]) is not list:
                raise Refused(f"APPEND to something other than a list: {_what(stack[-1])}")
            stack[-1].extend(items)
        elif op == 0x74:  # TUPLE
            items, stack = stack, metastack.pop()
            stack.append(tuple(items))
        elif op == 0x86 or op == 0x87:  # TUPLE2, TUPLE3
            n = op - 0x84
            if len(stack) < n:
                raise IndexError("list index out of range")  # as torch's stack[-n] raises
            stack[-n:] = [tuple(stack[-n:])]
        elif op in _CONSTANTS:
            stack.append(_CONSTANTS[op])
        elif op in _EMPTY:
            stack.append(_EMPTY[op]())
        elif op in _FIXED:
            stack.append(_FIXED[op].unpack_from(pkl, pos)[0])
            pos += _FIXED[op].size
        elif op == 0x55 or op == 0x8A:  # SHORT_BINSTRING, LONG1
            n = pkl[pos]
            raw = pkl[pos + 1 : pos + 1 + n]
            if len(raw) != n:
                raise EOFError("truncated")
            stack.append(raw.decode("utf-8") if op == 0x55 else int.from_bytes(raw, "little", signed=True))
            pos += 1 + n
        elif op == 0x63:  # GLOBAL
            nl1 = pkl.index(b"\n", pos)
            nl2 = pkl.index(b"\n", nl1 + 1)
            module, name = names.py2_rename(pkl[pos:nl1].decode("utf-8"), pkl[nl1 + 1 : nl2].decode("utf-8"))
            pos = nl2 + 1
            full = f"{module}.{name}"
            if module in names.BLOCKED_MODULES:
                raise Refused(f"Trying to load unsupported GLOBAL {full} whose module {module} is blocked.", full)
            if full not in rules.globals:
                raise Refused(f"Unsupported global: GLOBAL {full} was not an allowed global by default.", full)
            stack.append(_Global(full))
        elif op == 0x62:  # BUILD
            state = stack.pop()
            if not _buildable(stack[-1], state, rules):
                raise Refused(f"BUILD on {_what(stack[-1])} (only tensors, OrderedDicts and allowed types)")
        elif op == 0x51:  # BINPERSID: torch's persistent_load of ("storage", class, key, location, numel)
            pid: Any = stack.pop()
            if type(pid) is not tuple and type(pid) is not int:
                raise Refused(f"persistent_load id must be tuple or int, but got {type(pid)}")
            if type(pid) is tuple and pid and pid[0] not in ("storage", b"storage"):
                raise Refused(f"Only persistent_load of storage is allowed, but got {type(pid[0])}")
            five: Any = pid if type(pid) is tuple and len(pid) == 5 else (None,) * 5
            kind = five[1]
            if not (isinstance(kind, _Global) and kind.name.endswith("Storage") and type(five[4]) is int
                    and isinstance(five[2], str) and has_record(five[2])):  # fmt: skip
                raise KeyError("a persistent id that names no storage record of the archive")
            stack.append(_Made(kind.name, pid))
        elif op == 0x2E:  # STOP
            value = stack.pop()
            if strict and (stack or metastack or pos != end or isinstance(value, _Global)):
                raise Refused("STOP with more than one value, bytes after it, or a bare global")
            return
        elif op == 0x80:  # PROTO: torch only warns about a protocol other than 2
            pos += 1
        else:
            raise Refused(f"Unsupported operand {op}")
