"""A planted DCP ``.metadata`` cannot change torch's objects for the process, not even while
it loads (docs/security.md).

C pickle's ``BUILD`` sets the state of whatever is on its stack; what ``find_class`` returns
is shared by every thread. The loader hands it sealed stand-ins: a ``BUILD`` on one is
refused within the load, before anything is set, and a load's objects are still exactly
what DCP's own reader makes.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md

from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format.pickles import allowlists as names
from lightning_preempt.format.pickles.metadata import check_metadata_pickle, stand_in_class, unpickle_metadata
from lightning_preempt.format.pickles.unpickle import dcp_metadata, unpickle_dcp_metadata

P2, DICT, SETITEM, BUILD, STOP, NONE, TRUE, POP = b"\x80\x02", b"}", b"s", b"b", b".", b"N", b"\x88", b"0"
HONEST = pickle.dumps(dcp_md.Metadata(state_dict_metadata={}), protocol=2)


def _u(text: str) -> bytes:  # BINUNICODE
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _g(full: str) -> bytes:  # GLOBAL
    module, _, name = full.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _planted(push: bytes, state: bytes) -> bytes:
    """``push`` (leaves one object), ``BUILD`` it with ``state``, drop it, then an honest
    ``Metadata``: a file that loads whole if the ``BUILD`` goes through."""
    return P2 + push + state + BUILD + POP + HONEST[2:]


SLOTS = NONE + DICT + _u("poisoned") + TRUE + SETITEM + b"\x86"  # (None, {"poisoned": True}): setattr
DICT_STATE = DICT + _u("poisoned") + TRUE + SETITEM  # {"poisoned": True}: obj.__dict__ updated
CSM = "torch.distributed.checkpoint.metadata.ChunkStorageMetadata"
ENCODING = "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"
GET_LAYOUT = "torch.serialization._get_layout"


def _shared(obj: Any) -> dict[str, Any]:
    """What a ``BUILD`` could change of ``obj`` (a copy of its ``__dict__``; none: ``{}``)."""
    return dict(vars(obj)) if hasattr(obj, "__dict__") else {}


def _loads_of_each_kind() -> Iterator[tuple[str, bytes, Callable[[], Any]]]:
    """(name, what pushes it, the process-wide object it reaches) for every allowed global,
    and for what the two allowed callables give back (a shared enum member, a layout)."""
    for full in sorted(names.METADATA_GLOBALS):
        module, _, attr = full.rpartition(".")
        yield full, _g(full), lambda module=module, attr=attr: getattr(sys.modules[module], attr)
    member = dcp_md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    yield "a _MEM_FORMAT_ENCODING member", _g(ENCODING) + b"K\x00\x85R", lambda: member
    yield "a layout", _g(GET_LAYOUT) + _u("torch.strided") + b"\x85R", lambda: torch.strided


KINDS = list(_loads_of_each_kind())


@pytest.mark.parametrize("state", [SLOTS, DICT_STATE], ids=["slot state", "dict state"])
@pytest.mark.parametrize(("name", "push", "target"), KINDS, ids=[k[0] for k in KINDS])
def test_a_build_on_anything_find_class_returns_is_refused_and_changes_nothing(
    name: str, push: bytes, target: Callable[[], Any], state: bytes
) -> None:
    """Every global the loader resolves, and what its callables return that is shared: a
    ``BUILD`` on it is refused by the load and by ``verify``, and the process-wide object is
    as it was. (Before, a ``BUILD`` on ``_get_layout``'s ``__dict__`` poisoned the layout
    cache every ``torch.load`` reads, and one on an enum member changed its ``_value_``.)"""
    before = _shared(target())
    planted = _planted(push, state)
    with pytest.raises(CorruptCheckpointError):
        unpickle_dcp_metadata(planted, path="ckpt")
    assert _shared(target()) == before and not hasattr(target(), "poisoned")
    with pytest.raises(CorruptCheckpointError):
        check_metadata_pickle(planted, path="ckpt", manifest=None)
    assert unpickle_dcp_metadata(HONEST, path="ckpt") == dcp_md.Metadata(state_dict_metadata={})


REWRITES = {  # a BUILD that, let through, would change what every thread's DCP uses
    "ChunkStorageMetadata.__init__ = torch.Size": (
        _g(CSM), NONE + DICT + _u("__init__") + _g("torch.Size") + SETITEM + b"\x86",
        lambda: vars(dcp_md.ChunkStorageMetadata)["__init__"],
    ),
    "_get_layout.cache = {'torch.strided': torch.float32}": (
        _g(GET_LAYOUT), DICT + _u("cache") + DICT + _u("torch.strided") + _g("torch.float32") + SETITEM + SETITEM,
        lambda: torch.serialization._get_layout.__dict__.get("cache"),
    ),
    "TORCH_CONTIGUOUS_FORMAT._value_ = 1": (
        _g(ENCODING) + b"K\x00\x85R", DICT + _u("_value_") + b"K\x01" + SETITEM,
        lambda: dcp_md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT._value_,
    ),
}  # fmt: skip


@pytest.mark.parametrize("rewrite", list(REWRITES))
def test_no_thread_sees_a_rewrite_while_the_file_loads(rewrite: str) -> None:
    """What another thread (a background DCP save) would read of torch's object, read at every
    Python call and return of the load itself (a profile hook: deterministic, no threads):
    never anything else. The former fix compared the classes after the load and put them
    back; in between, every thread saw the rewritten class."""
    push, state, read = REWRITES[rewrite]
    planted = P2 + b"(" + push + state + BUILD + POP + HONEST[2:-1] + b"t" + STOP  # a GLOBAL after the BUILD
    expected = read()
    expected_copy = dict(expected) if isinstance(expected, dict) else expected
    seen: list[Any] = []

    def probe(frame: FrameType, event: str, arg: Any) -> None:
        now = read()
        seen.append(now is expected and (not isinstance(now, dict) or now == expected_copy))

    sys.setprofile(probe)
    try:
        with pytest.raises(CorruptCheckpointError, match="sets attributes of"):
            unpickle_dcp_metadata(planted, path="ckpt")
    finally:
        sys.setprofile(None)
    assert seen and all(seen), f"the rewrite was visible at {seen.count(False)} of {len(seen)} points"
    assert read() is expected


def _dcp_saved(tmp_path: Path) -> tuple[bytes, Any]:
    """A ``.metadata`` DCP writes (dtypes, shapes, a channels-last ``TensorProperties``) and what
    DCP's own reader makes of it."""
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
    state = {"w": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16), "i": torch.arange(5)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    theirs = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    theirs.state_dict_metadata["w"].properties.memory_format = torch.channels_last
    theirs.storage_meta = None  # (its checkpoint_id is a Path: not a global the loader allows)
    data = pickle.dumps(theirs)
    return data, pickle.loads(data)


def _nodes(obj: Any) -> Iterator[Any]:
    yield obj
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _nodes(key)
            yield from _nodes(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _nodes(value)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for value in vars(obj).values():
            yield from _nodes(value)


def test_a_load_gives_exactly_what_dcps_reader_gives(tmp_path: Path) -> None:
    """The stand-ins make torch's own objects: equal to DCP's reading, node for node of the
    very same types, and pickled again to the very same bytes."""
    data, theirs = _dcp_saved(tmp_path)
    ours = dcp_metadata(data, path="ckpt", manifest=None)
    assert ours == theirs
    assert [type(n) for n in _nodes(ours)] == [type(n) for n in _nodes(theirs)]
    assert type(ours) is dcp_md.Metadata and type(ours.state_dict_metadata["w"]) is dcp_md.TensorStorageMetadata
    assert ours.state_dict_metadata["w"].properties.memory_format == torch.channels_last
    assert ours.state_dict_metadata["b"].properties.dtype is torch.bfloat16
    assert pickle.dumps(ours) == data


class _WithInit:
    def __init__(self, value: int) -> None:
        self.value, self.inited = value, True


class _WithNew(_WithInit):
    def __new__(cls, *args: Any) -> _WithNew:
        made = super().__new__(cls)
        made.new_args = args
        return made


@pytest.mark.parametrize("real", [_WithInit, _WithNew], ids=["object.__new__ (in C)", "a __new__ of its own"])
def test_a_stand_in_class_makes_its_class_objects_as_the_class_would(real: type) -> None:
    """Through C pickle: ``NEWOBJ`` on the stand-in is ``real.__new__(real, *args)`` (no
    ``__init__``), ``REDUCE`` is ``real(*args)``, both objects of exactly ``real``; ``BUILD`` on
    an object sets its state, on the stand-in itself is refused."""
    sealed = stand_in_class(real)
    resolve: Callable[[str, str], Any] = lambda module, name: sealed if name == "C" else None  # noqa: E731
    newobj = P2 + _g("m.C") + b"K\x07\x85\x81" + DICT + _u("built") + TRUE + SETITEM + BUILD + STOP
    made = unpickle_metadata(newobj, "ckpt", resolve)
    assert type(made) is real and made.built and not hasattr(made, "inited")
    assert getattr(made, "new_args", (7,)) == (7,)
    called = unpickle_metadata(P2 + _g("m.C") + b"K\x07\x85R" + STOP, "ckpt", resolve)
    assert type(called) is real and called.inited and called.value == 7
    with pytest.raises(CorruptCheckpointError, match="sets attributes of _With"):
        unpickle_metadata(P2 + _g("m.C") + SLOTS + BUILD + STOP, "ckpt", resolve)
    with pytest.raises(Exception, match=real.__name__):
        sealed.poisoned = True
    assert not hasattr(real, "poisoned") and not hasattr(sealed, "poisoned")
