"""The torch-free loadability check (format/pickles/check.py, format/pickles/metadata.py) says what the loader says.

``lightning-preempt verify`` walks the pickles of a checkpoint against the loader's
allow-lists instead of unpickling them with torch (format/pickles/unpickle.py). Here both run on
the same bytes, from checkpoints the plugin writes and from crafted ones (every crafted
file gets past the CRC, as an attacker's would): they must accept the same ones and refuse
the others with the same error. The guard tests pin the static allow-lists to what the
installed torch and NumPy really allow, so ``verify`` never says "loads" where the load
would refuse.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_preempt.errors import CheckpointError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import checkpoint_name
from lightning_preempt.format.pickles import allowlists
from lightning_preempt.format.pickles import unpickle as torch_path
from lightning_preempt.format.pickles.check import check_state_pickle
from lightning_preempt.format.pickles.metadata import check_dcp_structure, check_metadata_pickle
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.read.verify import read_manifest
from lightning_preempt.storage.store import Store

STATE = "state-rank00000.pt"


# ---- checkpoints the plugin writes ------------------------------------------------------------
def _checkpoint(step: int, **extra: Any) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"epoch": 0, "global_step": step, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "hyper_parameters": {"lr": 0.1, "layers": (1, 2)}, "rng": torch.get_rng_state(), **extra}  # fmt: skip


#: Everything unusual that the loader still accepts without trust_checkpoints.
ALLOWED_ODDITIES: dict[str, Any] = {
    "lightning_preempt": {"rng": {"numpy": np.random.RandomState(3).get_state()}, "x": np.float64(2.5)},
    "callbacks": {
        "Odd": {"set": {1, 2}, "complex": 1 + 2j, "bytes": b"\x00\xff", "bytearray": bytearray(b"ab"),
                "device": torch.device("cpu"), "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
                "param": torch.nn.Parameter(torch.ones(2)), "half": torch.ones(2, dtype=torch.float16),
                "fp8": torch.zeros(2, dtype=torch.float8_e4m3fn), "bool": torch.tensor([True]),
                "od": collections.OrderedDict(a=1), "counter": collections.Counter("aab"),
                "arrays": [np.arange(2, dtype=t) for t in (np.int8, np.uint16, np.int32, np.float16, np.bool_)]},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of the plugin: a plain one (step 1) and one holding every allowed oddity (step 2)."""
    root = tmp_path_factory.mktemp("replay")
    io_ = ShardedAsyncCheckpointIO()
    io_.save_checkpoint(_checkpoint(1), str(root / checkpoint_name(1)))
    io_.save_checkpoint(_checkpoint(2, **ALLOWED_ODDITIES), str(root / checkpoint_name(2)))
    io_.teardown()
    return root


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of a real ``trainer.fit`` (Lightning's own dict: loops, hparams, callbacks)."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_preempt import PreemptionCallback

    class Tiny(L.LightningModule):
        def __init__(self, width: int = 8) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(4, width)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    root = tmp_path_factory.mktemp("fitted")
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[PreemptionCallback(str(root), every_n_train_steps=2)],
                        plugins=[ShardedAsyncCheckpointIO()])  # fmt: skip
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
    return root / checkpoint_name(2)


# ---- both checks on the same bytes ------------------------------------------------------------
def _outcome(check: Callable[[], Any]) -> tuple[str, str | None, str]:
    """(error type or "ok", global_name, first line of the message)."""
    try:
        check()
    except CheckpointError as err:
        return type(err).__name__, getattr(err, "global_name", None), str(err).splitlines()[0]
    return "ok", None, ""


def _state_outcomes(data: bytes) -> tuple[tuple[str, str | None, str], tuple[str, str | None, str]]:
    return (
        _outcome(lambda: torch_path.load_state_bytes(data, path="ckpt")),
        _outcome(lambda: check_state_pickle(data, path="ckpt")),
    )


def _same_verdict(with_torch: tuple[str, str | None, str], replayed: tuple[str, str | None, str]) -> bool:
    """Same error class and global; the same message when a global is named (otherwise the
    detail is torch's own wording, or the exception the archive reader raised)."""
    return with_torch[:2] == replayed[:2] and (with_torch[1] is None or with_torch[2] == replayed[2])


def _metadata_outcomes(data: bytes, manifest: Manifest | None) -> tuple[Any, Any]:
    def with_torch() -> None:
        check_dcp_structure(torch_path.unpickle_dcp_metadata(data, path="ckpt"), path="ckpt", manifest=manifest)

    return _outcome(with_torch), _outcome(lambda: check_metadata_pickle(data, path="ckpt", manifest=manifest))


def _files(ckpt: Path) -> tuple[bytes, bytes, Manifest]:
    return (ckpt / STATE).read_bytes(), (ckpt / ".metadata").read_bytes(), read_manifest(Store(str(ckpt)))


def test_both_accept_what_the_plugin_writes(written: Path, fitted: Path) -> None:
    for ckpt in (written / checkpoint_name(1), written / checkpoint_name(2), fitted):
        state, metadata, manifest = _files(ckpt)
        assert _state_outcomes(state) == (("ok", None, ""), ("ok", None, "")), ckpt
        assert _metadata_outcomes(metadata, manifest) == (("ok", None, ""), ("ok", None, "")), ckpt


# ---- crafted per-rank state -------------------------------------------------------------------
class Payload:
    """Unpickling it would run ``exec``."""

    def __reduce__(self) -> Any:
        return (exec, ("raise SystemExit('code from the checkpoint ran')",))


class Shell:
    def __reduce__(self) -> Any:
        return (os.system, ("true",))


@dataclasses.dataclass
class Opaque:
    value: int


def _saved(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def _repickled(data: bytes, edit: Callable[[bytes], bytes]) -> bytes:
    """The ``torch.save`` archive ``data`` with its ``data.pkl`` edited byte-wise."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = src.read(info)
            if info.filename.endswith("/data.pkl"):
                body, before = edit(body), body
                assert body != before, "the edit found nothing to change"
            dst.writestr(info, body)
    return out.getvalue()


def _with(**extra: Any) -> bytes:
    return _saved({"global_step": 3, "callbacks": extra})


def _edited_in_place(old: bytes, new: bytes) -> bytes:
    """A state archive with bytes of its pickle replaced in place (the zip's own CRC-32 left stale)."""
    data = _with(word="hello")
    assert data.count(old) == 1
    return data.replace(old, new)


STATE_CASES: dict[str, Callable[[], bytes]] = {
    "exec": lambda: _with(evil=Payload()),
    "os.system (blocked module)": lambda: _with(evil=Shell()),
    "user class": lambda: _with(mine=Opaque(7)),
    "builtins.slice": lambda: _with(s=slice(1, 2)),
    "frozenset": lambda: _with(s=frozenset([1])),
    "NumPy str array (dtype not allowed)": lambda: _with(a=np.array(["a"])),
    "NumPy object array": lambda: _with(a=np.array([None, 1], dtype=object)),
    "NumPy datetime": lambda: _with(a=np.datetime64("2020-01-01")),
    "pickle protocol 4 (opcodes torch refuses)": lambda: _saved({"x": 1}, pickle_protocol=4),
    "storage record missing": lambda: _repickled(_with(t=torch.ones(2)), lambda b: b.replace(b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x009")),
    # torch.save writes protocol 2, which names builtins as Python 2 did (__builtin__.set): both
    # loaders rename first. The Python 3 spelling is allowed too; a rename can also lead elsewhere.
    "Python 3 name of an allowed global": lambda: _repickled(_with(s={1}), lambda b: b.replace(b"c__builtin__\nset\n", b"cbuiltins\nset\n")),
    "Python 2 name renamed to functools.reduce": lambda: _repickled(_with(e=Payload()), lambda b: b.replace(b"c__builtin__\nexec\n", b"c__builtin__\nreduce\n")),
    "truncated archive": lambda: _with(a=1)[:-40],
    # torch's zip reader does not check a record's own CRC-32 (the manifest's CRC32C covers the file)
    "edited pickle, record CRC-32 stale (loads)": lambda: _edited_in_place(b"hello", b"hellp"),
    "unknown opcode, record CRC-32 stale": lambda: _edited_in_place(b"X\x05\x00\x00\x00hello", b"Z\x05\x00\x00\x00hello"),
}  # fmt: skip


@pytest.mark.parametrize("case", STATE_CASES, ids=list(STATE_CASES))
def test_crafted_state_same_verdict(case: str) -> None:
    data = STATE_CASES[case]()
    with_torch, replayed = _state_outcomes(data)
    assert _same_verdict(with_torch, replayed), (case, with_torch, replayed)
    if case.endswith(("Python 3 name of an allowed global", "(loads)")):
        assert replayed[0] == "ok"
    else:
        assert replayed[0] in ("UntrustedCheckpointError", "CorruptCheckpointError"), replayed


def test_payload_is_named_as_the_loader_names_it() -> None:
    _, replayed = _state_outcomes(STATE_CASES["exec"]())
    assert replayed[:2] == ("UntrustedCheckpointError", "builtins.exec")
    assert "needs the global builtins.exec, which is not on the allow-list" in replayed[2]
    _, replayed = _state_outcomes(STATE_CASES["Python 2 name renamed to functools.reduce"]())
    assert replayed[1] == "functools.reduce"


def test_non_zip_state_is_refused_by_both() -> None:
    """The one known difference: a state file that is not a zip archive. The load falls back
    to torch's legacy format (garbage: refused as untrusted; a real legacy file: loaded);
    the replay calls every non-zip state corrupt. Stricter, never looser: the writer only
    writes zip archives."""
    with_torch, replayed = _state_outcomes(b"\x80\x02garbage")
    assert with_torch[0] == "UntrustedCheckpointError" and replayed[0] == "CorruptCheckpointError"
    with_torch, replayed = _state_outcomes(_saved({"x": 1}, _use_new_zipfile_serialization=False))
    assert with_torch[0] == "ok" and replayed[0] == "CorruptCheckpointError"


# ---- crafted DCP .metadata ----------------------------------------------------------------------
def _edited(metadata: bytes, edit: Callable[[Any], Any]) -> bytes:
    md = torch_path.unpickle_dcp_metadata(metadata, path="x")
    return pickle.dumps(edit(md) or md)


def _first_record(md: Any) -> Any:
    return next(iter(md.storage_data.values()))


def _set(obj: Any, **fields: Any) -> None:
    for k, v in fields.items():
        setattr(obj, k, v)


def _byte_io(md: Any) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md.state_dict_metadata["obj"] = BytesStorageMetadata()


METADATA_CASES: dict[str, Callable[[bytes], bytes]] = {
    "exec": lambda honest: pickle.dumps(Payload()),
    "another torch class": lambda honest: pickle.dumps(torch.nn.Identity),
    "byte-IO item": lambda honest: _edited(honest, _byte_io),
    "path out of the checkpoint": lambda honest: _edited(honest, lambda md: _set(_first_record(md), relative_path="../../x.distcp")),
    "absolute path": lambda honest: _edited(honest, lambda md: _set(_first_record(md), relative_path="/etc/hostname")),
    "shard not in the manifest": lambda honest: _edited(honest, lambda md: _set(_first_record(md), relative_path="__9_0.distcp")),
    "record beyond the end": lambda honest: _edited(honest, lambda md: _set(_first_record(md), length=1 << 40)),
    "negative offset": lambda honest: _edited(honest, lambda md: _set(_first_record(md), offset=-1)),
    "stream transforms": lambda honest: _edited(honest, lambda md: _set(_first_record(md), transform_descriptors=["zstd"])),
    "not Metadata": lambda honest: pickle.dumps({"state_dict_metadata": {}}),
    "a key that is not an index": lambda honest: _edited(honest, lambda md: _set(md, storage_data={"k": _first_record(md)})),
    "garbage": lambda honest: b"\x80\x04garbage",
    "truncated": lambda honest: honest[: len(honest) // 2],
}  # fmt: skip


@pytest.mark.parametrize("case", METADATA_CASES, ids=list(METADATA_CASES))
def test_crafted_metadata_same_verdict(case: str, written: Path) -> None:
    _, honest, manifest = _files(written / checkpoint_name(1))
    with_torch, replayed = _metadata_outcomes(METADATA_CASES[case](honest), manifest)
    assert with_torch == replayed, case
    assert replayed[0] in ("UntrustedCheckpointError", "CorruptCheckpointError"), replayed


def test_one_structure_check_serves_real_objects_too(written: Path) -> None:
    """check_dcp_structure gives the same verdict on torch's real objects (the load path) as
    on the torch-free replay's stand-ins (``verify``): one structural checker serves both."""
    _, honest, manifest = _files(written / checkpoint_name(1))
    for case in ("path out of the checkpoint", "record beyond the end", "stream transforms", "byte-IO item"):
        if case == "byte-IO item":  # refused while unpickling; build the object by hand
            md = torch_path.unpickle_dcp_metadata(honest, path="x")
            _byte_io(md)
        else:
            md = torch_path.unpickle_dcp_metadata(METADATA_CASES[case](honest), path="x")
        real = _outcome(lambda md=md: check_dcp_structure(md, path="ckpt", manifest=manifest))
        assert real[0] == "CorruptCheckpointError", case
        if case != "byte-IO item":  # (the replay refuses that one while unpickling, as torch does)
            stand_ins = _outcome(lambda case=case: check_metadata_pickle(METADATA_CASES[case](honest), path="ckpt",
                                                                       manifest=manifest))  # fmt: skip
            assert stand_ins == real, case
    md = torch_path.unpickle_dcp_metadata(honest, path="x")
    check_dcp_structure(md, path="ckpt", manifest=manifest)


# ---- the static allow-lists are what the installed torch and NumPy allow ----------------------------
def _qualified(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def test_state_allow_list_is_what_the_loader_allows() -> None:
    """The copy of torch's defaults is torch's (``verify`` must not say "loads" where the
    load refuses, nor the reverse: a new torch default is a name to add to allowlists.py),
    and each of the package's own names resolves to the object of that name."""
    from torch import _weights_only_unpickler

    torch_defaults = set(_weights_only_unpickler._get_allowed_globals())
    assert torch_defaults == allowlists.TORCH_WEIGHTS_ONLY_GLOBALS
    ours = {_qualified(g) for g in torch_path.skeleton_safe_globals()}
    assert ours == allowlists.OURS | allowlists.NUMPY_GLOBALS
    assert torch_defaults | ours == allowlists.STATE_GLOBALS


def test_numpy_dtype_codes_are_the_allowed_dtype_classes() -> None:
    for code, name in allowlists.NUMPY_DTYPES.items():
        assert _qualified(type(np.dtype(code))) == f"numpy.dtypes.{name}DType", code
    assert {np.dtype(t).__reduce__()[1][0] for t in (np.int64, np.float32, np.bool_)} <= set(allowlists.NUMPY_DTYPES)


def test_metadata_allow_list_is_what_the_loader_allows() -> None:
    for name in allowlists.METADATA_GLOBALS:  # each resolves, to (a sealed stand-in of) that name or a dtype
        found = torch_path._metadata_global(*name.rsplit(".", 1))
        sealed_function = isinstance(found, torch_path.SealedFunction) and found.name == name
        assert isinstance(found, torch.dtype) or sealed_function or _qualified(found) == name, name
    installed = {f"torch.{n}" for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert installed <= allowlists.METADATA_GLOBALS, installed - allowlists.METADATA_GLOBALS  # a new dtype: add it


def test_python2_renames_are_torchs() -> None:
    from torch import _utils

    assert allowlists._IMPORT_MAPPING == _utils.IMPORT_MAPPING
    assert allowlists._NAME_MAPPING == _utils.NAME_MAPPING


# ---- the fast road (format/pickles/unpickle.py) ------------------------------------------------
def _weights_only(data: bytes) -> Any:
    with torch.serialization.safe_globals(torch_path.skeleton_safe_globals()):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_fast_path_takes_what_a_fit_writes_and_gives_what_weights_only_gives(written: Path, fitted: Path) -> None:
    from lightning_preempt.format.pickles.unpickle import fast_load_state

    for ckpt in (written / checkpoint_name(1), fitted):
        data = (ckpt / STATE).read_bytes()
        fast = fast_load_state(data, "cpu")  # no OffFastPath: the common case is fast
        assert _equal(fast, _weights_only(data)), ckpt
    fit_state = (fitted / STATE).read_bytes()
    assert b"numpy" in fit_state  # the exact-resume RNG state: NumPy's wrapped globals were used


@pytest.mark.parametrize("case", STATE_CASES, ids=list(STATE_CASES))
def test_fast_path_never_accepts_what_weights_only_refuses(case: str) -> None:
    """The fast path loads a subset of what the weights-only path loads, the same objects;
    for everything else it steps aside (OffFastPath) and load_state_bytes asks torch."""
    from lightning_preempt.format.pickles.unpickle import OffFastPath, fast_load_state

    data = STATE_CASES[case]()
    try:
        expected = _weights_only(data)
    except Exception:
        with pytest.raises(OffFastPath):
            fast_load_state(data, "cpu")
        return
    try:
        got = fast_load_state(data, "cpu")
    except OffFastPath:
        got = torch_path.load_state_bytes(data, path="ckpt")  # what the loader then does
    assert _equal(got, expected), case


def test_fast_path_steps_aside_for_the_allowed_oddities(written: Path) -> None:
    """NumPy scalars, sets, Parameters… are allowed but not on the fast path: the loader
    still returns exactly what weights_only returns."""
    from lightning_preempt.format.pickles.unpickle import OffFastPath, fast_load_state

    data = (written / checkpoint_name(2) / STATE).read_bytes()
    with pytest.raises(OffFastPath):
        fast_load_state(data, "cpu")
    assert _equal(torch_path.load_state_bytes(data, path="ckpt"), _weights_only(data))


def test_fast_path_wraps_numpy_so_only_allowed_types_are_built() -> None:
    from lightning_preempt.format.pickles.unpickle import OffFastPath, fast_globals

    g = fast_globals(True)
    make_dtype = next(v for (m, n), v in g.items() if n == "dtype" and m == "numpy")
    assert make_dtype("u4") == np.dtype("u4")
    for refused in ("U5", "O", "M8[D]"):
        with pytest.raises(OffFastPath):
            make_dtype(refused)
    assert not any(n == "scalar" for _, n in g)
