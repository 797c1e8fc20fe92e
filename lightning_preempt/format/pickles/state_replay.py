"""Would ``load_state_bytes`` accept this state file? Answered without torch, for ``verify``:
``data.pkl`` is replayed under ``weights_only`` rules with inert stand-ins, raising the error
the load would (tests/unit/test_pickle_replay.py runs both on the same bytes). Also: which
globals a pickle imports (:func:`pickle_globals`, for ``export``), read without running it.
"""

from __future__ import annotations

import io
import pickletools
import re
import struct
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from lightning_preempt.errors import CheckpointError, CorruptCheckpointError, UntrustedCheckpointError
from lightning_preempt.format.pickles.allowlists import BLOCKED_MODULES, NUMPY_DTYPE_CODES, STATE_GLOBALS, py2_rename
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


class _Refused(Exception):
    """What torch's weights-only unpickler refuses (it raises ``UnpicklingError`` there)."""

    def __init__(self, detail: str, global_name: str | None = None) -> None:
        super().__init__(detail)
        self.global_name = global_name


# ---- the per-rank state: a replay of torch.load(weights_only=True) ---------------------------
def check_state_pickle(data: bytes, *, path: str) -> None:
    """Raise what ``load_state_bytes(data, path=path)`` would raise, without torch."""
    try:
        prefix, pkl, names = _pickle_of(data, path)
        records = set(names)
    except CheckpointError:
        raise
    except Exception as err:  # not a zip, a record failing its CRC, an unknown compression...
        raise corrupt_state_error(f"not a readable zip archive: {type(err).__name__}: {str(err)[:200]}", path) from None
    try:
        _WeightsOnlyReplay(pkl, lambda key: f"{prefix}/data/{key}" in records).run()
    except _Refused as err:
        raise untrusted_state_error(err.global_name, str(err), path) from None
    except (ValueError, TypeError, KeyError, IndexError, EOFError) as err:
        raise corrupt_state_error(f"{type(err).__name__}: {str(err)[:200]}", path) from None


def archived_pickle(data: bytes) -> bytes:
    """The ``data.pkl`` bytes of ``data``; raises when two zip readers could read different
    records from it (format/pickles/zip_layout.py)."""
    return _pickle_of(data, "")[1]


def _pickle_of(data: bytes, path: str) -> tuple[str, bytes, list[str]]:
    """The archive's directory name, its ``data.pkl`` bytes and every record's name, from an
    archive with one reading only (torch's reader would read another ``data.pkl``)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        try:
            check_one_reading(data, archive)
        except AmbiguousArchive as err:
            raise corrupt_state_error(f"not laid out as torch.save writes: {err}", path) from None
        prefix, info = _archive_pickle(archive, path)
        return prefix, _record_bytes(archive, info, data), archive.namelist()


def _archive_pickle(archive: zipfile.ZipFile, path: str) -> tuple[str, zipfile.ZipInfo]:
    """The archive's directory name and its ``data.pkl``, checked as torch's reader checks them."""
    names = archive.namelist()
    prefix = names[0].split("/", 1)[0] if names else ""
    if not names or any(not n.startswith(prefix + "/") for n in names):
        raise corrupt_state_error("its records are not in one directory", path)
    if f"{prefix}/constants.pkl" in names:
        raise corrupt_state_error("a TorchScript archive", path)
    order = archive.NameToInfo.get(f"{prefix}/byteorder")
    if order is not None and archive.read(order) not in (b"little", b"big"):
        raise corrupt_state_error("unknown byte order", path)
    info = archive.NameToInfo.get(f"{prefix}/data.pkl")
    if info is None:
        raise corrupt_state_error("no data.pkl", path)
    if info.file_size > MAX_PICKLE_BYTES:
        raise corrupt_state_error(f"data.pkl holds {info.file_size} bytes", path)
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
_EMPTY: dict[str, Callable[[], Any]] = {"EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_SET": set}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
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
        elif name in _EMPTY:
            self.stack.append(_EMPTY[name]())
        elif name in _TUPLES:
            n = _TUPLES[name]
            if len(self.stack) < n:
                raise IndexError("list index out of range")  # as torch's stack[-n] raises
            self.stack[-n:] = [tuple(self.stack[-n:])]
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
        module, name = py2_rename(module, name)
        full = f"{module}.{name}"
        if module in BLOCKED_MODULES:
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


# ---- which globals a pickle imports (whether it would load is the replay's question) ---------
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
