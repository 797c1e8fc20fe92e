"""A planted state file cannot change the process through the fast road's C pickle (issue 32).

Each crafted file is loaded the way resume loads it (``load_state_bytes``): the fast path
must refuse it before C pickle runs, the process-wide objects it aimed at must be
unchanged, and a clean file loaded right after must give exactly its values.
"""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from typing import Any

import numpy as np
import pytest
import torch

from lightning_preempt.errors import UntrustedCheckpointError
from lightning_preempt.format import TensorRef
from lightning_preempt.format.pickles.unpickle import OffFastPath, fast_load_state, load_state_bytes


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _with_pickle(pkl: bytes, base: bytes | None = None) -> bytes:
    """A real ``torch.save`` archive whose ``data.pkl`` is ``pkl`` (an attacker writes the whole file)."""
    out = io.BytesIO()
    source = base if base is not None else _saved({"x": 1})
    with zipfile.ZipFile(io.BytesIO(source)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


def _twice(first: bytes, second: bytes) -> bytes:
    """An archive listing ``data.pkl`` twice: zipfile reads the last, torch's reader may read another."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_saved({"x": 1}))) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename.endswith("/data.pkl"):
                dst.writestr(info, first)
                with pytest.warns(UserWarning, match="Duplicate name"):
                    dst.writestr(info, second)
            else:
                dst.writestr(info, src.read(info))
    return out.getvalue()


def _case_twin(checked: bytes, read: bytes) -> bytes:
    """``data.pkl`` (``checked``: what zipfile finds) then ``DATA.pkl`` (``read``): torch's reader
    looks names up ignoring case and finds the second (issue 55)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_saved({"x": 1}))) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, checked if info.filename.endswith("/data.pkl") else src.read(info))
            if info.filename.endswith("/data.pkl"):
                dst.writestr(zipfile.ZipInfo(info.filename.replace("data.pkl", "DATA.pkl")), read)
    return out.getvalue()


def _glued(read: bytes) -> bytes:
    """An archive whose ``data.pkl`` is ``read`` followed by one whose is a clean ``{"xx…": 1}``
    of the same length (so both central directories sit at the same offset in their archives):
    zipfile reads the second archive (it shifts offsets by what precedes it), torch's reader
    the first (it takes the end record's offsets as they are) (issue 55)."""
    checked = P2 + DICT + _u("x" * (len(read) - 12)) + b"K\x01" + SETITEM + STOP
    first, second = _with_pickle(read), _with_pickle(checked)
    assert len(read) == len(checked) and len(first) == len(second)
    return first + second


def _edited(obj: Any, old: bytes, new: bytes) -> bytes:
    data = _saved(obj)
    with zipfile.ZipFile(io.BytesIO(data)) as src:
        pkl = src.read(next(n for n in src.namelist() if n.endswith("/data.pkl")))
    assert pkl.count(old) == 1
    return _with_pickle(pkl.replace(old, new), data)


def _u(text: str) -> bytes:  # BINUNICODE
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _g(module: str, name: str) -> bytes:  # GLOBAL
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


P2, DICT, SETITEM, BUILD, STOP, NONE, TRUE = b"\x80\x02", b"}", b"s", b"b", b".", b"N", b"\x88"

def _build_on_global(module: str, name: str, attr_and_value: bytes) -> bytes:
    """``{"f": <the global, after BUILD sets (None, {attr: value})>}``: a valid stack to STOP."""
    return P2 + DICT + _u("f") + _g(module, name) + NONE + DICT + attr_and_value + SETITEM + b"\x86" + BUILD + SETITEM + STOP


NEG_DEFAULTS = _u("__defaults__") + DICT + _u("neg") + TRUE + SETITEM + b"\x85"  # ({"neg": True},)
ATTACKS: dict[str, bytes] = {
    # every later tensor load would come back negated
    "BUILD on _rebuild_tensor_v2 (__defaults__)": _with_pickle(_build_on_global("torch._utils", "_rebuild_tensor_v2", NEG_DEFAULTS)),
    "BUILD on the TensorRef class": _with_pickle(_build_on_global("lightning_preempt.format", "TensorRef", _u("poisoned") + TRUE)),
    "BUILD on torch.Size": _with_pickle(_build_on_global("torch", "Size", _u("poisoned") + TRUE)),
    "BUILD on a tensor": _edited({"t": torch.ones(2)}, b"Rq\rs.", b"Rq\r" + NONE + DICT + _u("poisoned") + TRUE + SETITEM + b"\x86" + BUILD + b"s."),
    "memo index 1e8": _with_pickle(P2 + DICT + _u("a") + b"K\x01" + b"r" + (10**8).to_bytes(4, "little") + SETITEM + STOP),
    "memo index 2^32-1": _with_pickle(P2 + DICT + _u("a") + b"K\x01" + b"r\xff\xff\xff\xff" + SETITEM + STOP),
    "os.FloatStorage": _edited({"t": torch.ones(2)}, b"ctorch\nFloatStorage\n", b"cos\nFloatStorage\n"),
    "INST": _with_pickle(P2 + DICT + _u("a") + b"(" + b"icollections\nOrderedDict\n" + SETITEM + STOP),
    "OBJ": _with_pickle(P2 + DICT + _u("a") + b"(" + _g("collections", "OrderedDict") + b"o" + SETITEM + STOP),
    "NEWOBJ_EX": _with_pickle(P2 + DICT + _u("a") + _g("collections", "OrderedDict") + b")}\x92" + SETITEM + STOP),
    "EXT1": _with_pickle(P2 + DICT + _u("a") + b"\x82\x01" + SETITEM + STOP),
    "SETITEM on the TensorRef class": _with_pickle(P2 + _g("lightning_preempt.format", "TensorRef") + _u("k") + TRUE + SETITEM + STOP),
    "REDUCE of numpy.ndarray (allocates its shape)": _with_pickle(P2 + DICT + _u("a") + _g("numpy", "ndarray") + b"J\x00\x00\x00\x40\x85R" + SETITEM + STOP),
    "data.pkl twice (the checked one clean)": _twice(
        _build_on_global("torch._utils", "_rebuild_tensor_v2", NEG_DEFAULTS), P2 + DICT + _u("x") + b"K\x01" + SETITEM + STOP
    ),
    # issue 55: zipfile and torch's reader find two different data.pkl
    "data.pkl and DATA.pkl (torch reads the second)": _case_twin(
        P2 + DICT + _u("x") + b"K\x01" + SETITEM + STOP, _build_on_global("torch._utils", "_rebuild_tensor_v2", NEG_DEFAULTS)
    ),
    "two archives glued (torch reads the first)": _glued(_build_on_global("torch._utils", "_rebuild_tensor_v2", NEG_DEFAULTS)),
    "BUILD on an OrderedDict with slot state": _with_pickle(
        P2 + DICT + _u("a") + _g("collections", "OrderedDict") + b")R" + NONE + DICT + _u("x") + TRUE + SETITEM + b"\x86"
        + BUILD + SETITEM + STOP
    ),
}  # fmt: skip


TWO_READINGS = ["data.pkl and DATA.pkl (torch reads the second)", "two archives glued (torch reads the first)"]


def _process_wide() -> dict[str, Any]:
    """What the attacks aim at, as it stands in this process."""
    return {
        "defaults": torch._utils._rebuild_tensor_v2.__defaults__,
        "tensorref": dict(vars(TensorRef)),
        "size": dict(vars(torch.Size)),
        "f8": (np.dtype("f8").str, np.dtype("f8").byteorder, np.dtype("f8").isbuiltin),
    }


def _clean() -> tuple[bytes, dict[str, Any]]:
    values = {"t": torch.arange(6.0).reshape(2, 3), "ref": TensorRef("state_dict.w"), "step": 7,
              "rng": np.random.RandomState(5).get_state()}  # fmt: skip
    return _saved(values), values


def _check_clean_load() -> None:
    plain = torch.arange(4.0)  # what a later torch.load in the process (the user's, DCP's) returns
    loaded = torch.load(io.BytesIO(_saved({"w": plain})), weights_only=True)["w"]
    assert torch.equal(loaded, plain) and not loaded.is_neg(), "a later torch.load is poisoned"
    data, values = _clean()
    got = fast_load_state(data, "cpu")  # the clean file still takes the fast path
    assert list(got) == list(values)
    assert torch.equal(got["t"], values["t"]) and not got["t"].is_neg()
    assert got["ref"] == values["ref"] and type(got["ref"]) is TensorRef
    assert got["step"] == 7
    assert got["rng"][0] == values["rng"][0] and np.array_equal(got["rng"][1], values["rng"][1])
    assert got["rng"][1].dtype == values["rng"][1].dtype


@pytest.mark.parametrize("case", ATTACKS, ids=list(ATTACKS))
def test_planted_state_is_refused_before_c_pickle_runs(case: str) -> None:
    data = ATTACKS[case]
    before = _process_wide()
    with pytest.raises(OffFastPath):
        fast_load_state(data, "cpu")
    assert _process_wide() == before, "the fast path changed a process-wide object"
    try:  # what resume does: the weights-only loader decides
        load_state_bytes(data, path="ckpt")
    except UntrustedCheckpointError:
        pass
    except Exception as err:  # the weights-only verdict on a broken file: any CheckpointError
        assert type(err).__name__.endswith("CheckpointError"), err
    assert _process_wide() == before
    _check_clean_load()


def test_refused_globals_are_refused_by_the_loader_too() -> None:
    for case in ("BUILD on _rebuild_tensor_v2 (__defaults__)", "BUILD on the TensorRef class", "os.FloatStorage"):
        with pytest.raises(UntrustedCheckpointError):
            load_state_bytes(ATTACKS[case], path="ckpt")
    _check_clean_load()


def test_a_huge_memo_index_costs_no_memory() -> None:
    """The 100-byte file with memo index 1e8 took 1.8 GB through C pickle; now the fast
    path refuses it and the weights-only loader (a dict memo) reads it in a few MB."""
    code = (
        "import resource, sys; from lightning_preempt.format.pickles.unpickle import load_state_bytes; "
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "got = load_state_bytes(open(sys.argv[1], 'rb').read(), path='ckpt'); "
        "print(got, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)"
    )
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        f.write(ATTACKS["memo index 1e8"])
        f.flush()
        out = subprocess.run([sys.executable, "-c", code, f.name], capture_output=True, text=True, timeout=120, check=True)
    value, grown_mib = out.stdout.split("}")
    assert value + "}" == "{'a': 1}"
    assert int(grown_mib) < 200, f"loading grew the process by {grown_mib} MiB"


def test_numpy_dtype_is_built_on_a_copy() -> None:
    """np.dtype('f8', False, False) is NumPy's shared descriptor: the fast path makes a copy
    before BUILD sets its state, so a planted state cannot reach the shared one."""
    data = _edited({"rng": np.random.RandomState(3).get_state()}, b"\x89\x88\x87", b"\x89\x89\x87")
    before = _process_wide()
    got = fast_load_state(data, "cpu")
    assert got["rng"][1].dtype == np.dtype("uint32")
    assert _process_wide() == before


@pytest.mark.parametrize("case", TWO_READINGS)
def test_the_check_walks_the_record_torch_reads(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Each of the two defences holds alone: with the layout check out of the way, the opcode
    check still walks torch's own ``data.pkl`` (the poisoned one) and refuses it."""
    from lightning_preempt.format.pickles import check

    monkeypatch.setattr(check, "check_one_reading", lambda data, archive: None)
    before = _process_wide()
    with pytest.raises(OffFastPath, match=r"BUILD on torch\._utils\._rebuild_tensor_v2"):
        fast_load_state(ATTACKS[case], "cpu")
    assert _process_wide() == before
    _check_clean_load()


@pytest.mark.parametrize("case", TWO_READINGS)
def test_verify_calls_an_archive_with_two_readings_corrupt(case: str) -> None:
    """``verify`` replays zipfile's data.pkl: it must not vouch for a file torch reads otherwise."""
    from lightning_preempt.errors import CorruptCheckpointError
    from lightning_preempt.format.pickles.check import check_state_pickle

    with pytest.raises(CorruptCheckpointError, match=r"not laid out as torch\.save writes"):
        check_state_pickle(ATTACKS[case], path="ckpt")


def test_what_torch_save_writes_has_one_reading() -> None:
    """The layout rule refuses nothing torch.save writes (records aligned, data descriptors),
    and refuses one byte after the end record."""
    from lightning_preempt.errors import CorruptCheckpointError
    from lightning_preempt.format.pickles.check import archived_pickle

    many = {f"t{i}": torch.full((i % 7 + 1,), float(i)) for i in range(300)}
    for obj in (many, {"big": torch.ones(1 << 20)}, {"rng": np.random.RandomState(1).get_state()}, {}):
        data = _saved(obj)
        assert archived_pickle(data)[0][:2] == P2
        got = fast_load_state(data, "cpu")
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        assert list(got) == list(obj) and all(torch.equal(got[k], v) for k, v in tensors.items())
        with pytest.raises(CorruptCheckpointError, match="after the archive's end record"):
            archived_pickle(data + b"\0")


def test_zip64_end_records_are_read() -> None:
    """The layout rule reads zip64 end records (zipfile writes them past 65535 records, as
    torch.save's miniz does: the slow test below): the fast road loads the file."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_saved({"x": 1}))) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        for i in range(66_000):
            dst.writestr(f"archive/pad/{i}", b"")
    data = out.getvalue()
    assert data[-42:-38] == b"PK\x06\x07", "not a zip64 archive: the test no longer tests it"
    assert fast_load_state(data, "cpu") == {"x": 1}
    with pytest.raises(OffFastPath):  # the zip64 directory must end where its end record begins
        fast_load_state(data[:-98] + b"\0" + data[-98:], "cpu")


@pytest.mark.slow
def test_a_zip64_archive_from_torch_save_has_one_reading() -> None:
    """Over 65535 records, torch.save's miniz writes zip64 end records: the layout rule reads
    them, and the fast road still loads the file (66000 one-element tensors, ~18 MB)."""
    obj = {f"t{i}": torch.tensor([float(i)]) for i in range(66_000)}
    data = _saved(obj)
    assert data[-42:-38] == b"PK\x06\x07", "not a zip64 archive: the test no longer tests it"
    got = fast_load_state(data, "cpu")
    assert len(got) == len(obj) and float(got["t65999"]) == 65999.0 and float(got["t0"]) == 0.0


def test_a_planted_metadata_cannot_change_dcps_classes() -> None:
    """DCP's ``.metadata`` goes through C pickle too: a ``BUILD`` with a slot state on an allowed
    DCP *class* would set its attributes for the whole process (``ChunkStorageMetadata.__init__
    = torch.Size``: every later DCP plan broken). The load refuses the file and the class never
    changes (the unpickler only sees a sealed stand-in; tests/unit/test_metadata_sealed.py);
    ``verify`` (the stand-ins) refuses it too; an honest file still loads."""
    import pickle

    from torch.distributed.checkpoint import metadata as dcp_md

    from lightning_preempt.errors import CorruptCheckpointError
    from lightning_preempt.format.pickles.metadata import check_metadata_pickle
    from lightning_preempt.format.pickles.unpickle import unpickle_dcp_metadata

    honest = pickle.dumps(dcp_md.Metadata(state_dict_metadata={}), protocol=2)
    poison = _g("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata") + NONE + DICT + _u("__init__")
    planted = P2 + b"(" + poison + _g("torch", "Size") + SETITEM + b"\x86" + BUILD + b"0" + honest[2:-1] + b"t" + STOP
    before = dict(vars(dcp_md.ChunkStorageMetadata))
    with pytest.raises(CorruptCheckpointError, match="sets attributes of ChunkStorageMetadata"):
        unpickle_dcp_metadata(planted, path="ckpt")
    assert dict(vars(dcp_md.ChunkStorageMetadata)) == before
    chunk = dcp_md.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    assert chunk.sizes == torch.Size([2]) and chunk.offsets == torch.Size([0])
    with pytest.raises(CorruptCheckpointError):
        check_metadata_pickle(planted, path="ckpt", manifest=None)
    assert unpickle_dcp_metadata(honest, path="ckpt") == dcp_md.Metadata(state_dict_metadata={})
