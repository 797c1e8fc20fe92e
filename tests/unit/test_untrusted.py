"""Checkpoints from storage are untrusted input (issue 11, docs/security.md).

Every crafted checkpoint here has its manifest's sizes and CRC32C fixed up to match, as
an attacker with write access to the bucket would do: integrity checks pass, so what is
tested is that nothing runs, nothing outside the checkpoint is read, nothing that is not
ours is deleted, and odd fields are reported as damage.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckpts import lightning_like_checkpoint

from lightning_preempt.catalog import ownership, retention, verified
from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.catalog.newest import newest_valid
from lightning_preempt.catalog.retention import apply_retention
from lightning_preempt.cli.app import build_parser
from lightning_preempt.cli.app import main as cli_main
from lightning_preempt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointWriteError,
    CorruptCheckpointError,
    UnsupportedFormatError,
    UntrustedCheckpointError,
)
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name
from lightning_preempt.format.pickles.unpickle import unpickle_dcp_metadata
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.read.verify import read_manifest, verify_checkpoint
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.diagnose import storage_hint
from lightning_preempt.storage.store import Store
from lightning_preempt.write.commit import SaveRequest, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
STATE = "state-rank00000.pt"


# ---- crafting -----------------------------------------------------------------------------
class Payload:
    """Unpickling this creates ``marker``: proof that code from the checkpoint ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@dataclasses.dataclass
class Opaque:
    """A user's own class in callback state: loads only with the opt-in."""

    value: int


def _save(root: Path, steps: list[int], **ckpt_kw: Any) -> None:
    io = ShardedAsyncCheckpointIO()
    for step in steps:
        ckpt = lightning_like_checkpoint(step=step)
        ckpt.update(ckpt_kw)
        io.save_checkpoint(ckpt, str(root / checkpoint_name(step)))
    io.teardown()


def _replace_file(ckpt: Path, name: str, data: bytes) -> None:
    """Write ``ckpt/name`` and fix its size and CRC32C in the manifest (an attacker's edit)."""
    (ckpt / name).write_bytes(data)
    _fix_entry(ckpt, name, data)


def _fix_entry(ckpt: Path, name: str, data: bytes) -> None:
    crc = Crc32c()
    crc.update(data)
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    body["files"][name] = {"size": len(data), "crc32c": crc.hexdigest()}
    _write_manifest(ckpt, body)


def _write_manifest(ckpt: Path, body: Any, raw: bytes | None = None) -> None:
    path = ckpt / MANIFEST_NAME
    path.unlink()
    path.write_bytes(raw if raw is not None else json.dumps(body).encode())


def _edit_manifest(ckpt: Path, **fields: Any) -> None:
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    body.update(fields)
    _write_manifest(ckpt, body)


def _state_with(ckpt: Path, **extra: Any) -> bytes:
    """The checkpoint's own per-rank state plus ``extra`` keys, re-pickled."""
    import io

    skeleton = torch.load(ckpt / STATE, weights_only=False)  # our own honest file
    skeleton.update(extra)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return buf.getvalue()


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "PAYLOAD_RAN"
    yield path
    assert not path.exists(), "code from the checkpoint ran"


@pytest.fixture
def poisoned(tmp_path: Path, marker: Path) -> Path:
    """``root`` with steps 1 and 2; step 2's per-rank state carries a payload."""
    root = tmp_path / "ckpts"
    _save(root, [1, 2])
    ckpt = root / checkpoint_name(2)
    _replace_file(ckpt, STATE, _state_with(ckpt, callbacks={"Evil": Payload(marker)}))
    return root


# ---- no code runs -------------------------------------------------------------------------
def test_a_state_payload_never_runs_on_load_resume_or_weights_only(poisoned: Path, marker: Path) -> None:
    ckpt = str(poisoned / checkpoint_name(2))
    assert verify_checkpoint(Store(ckpt)).step == 2  # integrity holds: the CRC was fixed up
    with pytest.raises(UntrustedCheckpointError, match=r"builtins\.exec") as info:
        ShardedAsyncCheckpointIO().load_checkpoint(ckpt)
    assert "trust_checkpoints=True" in str(info.value) and "HINT:" in str(info.value)
    assert info.value.global_name == "builtins.exec"
    # the directory (auto-resume picks the newest) and an explicit weights_only=True, even
    # on a plugin that trusts checkpoints otherwise
    with pytest.raises(UntrustedCheckpointError):
        ShardedAsyncCheckpointIO().load_checkpoint(str(poisoned))
    with pytest.raises(UntrustedCheckpointError):
        ShardedAsyncCheckpointIO(trust_checkpoints=True).load_checkpoint(ckpt, weights_only=True)
    with pytest.raises(UntrustedCheckpointError):
        ShardedAsyncCheckpointIO(verify_on_load=False).load_checkpoint(ckpt)


def test_cli_export_and_verify_refuse_a_payload(
    poisoned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.ckpt"
    for extra in ([], ["--no-verify"]):
        code, _, err = _cli(capsys, "export", str(poisoned), str(out), *extra)
        assert code == 1 and "builtins.exec" in err and "--trust" in err and "HINT:" in err
        assert not out.exists()
    code, out_text, err = _cli(capsys, "verify", str(poisoned))
    assert code == 1 and out_text == "" and "sizes and CRC32C match, but" in err and "builtins.exec" in err
    code, out_text, _ = _cli(capsys, "verify", str(poisoned), "1")
    assert code == 0 and "loads without trust_checkpoints" in out_text


def test_the_opt_in_loads_arbitrary_objects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpts"
    _save(root, [3], callbacks={"Mine": {"opaque": Opaque(7)}})
    ckpt = str(root / checkpoint_name(3))
    with pytest.raises(UntrustedCheckpointError, match=r"test_untrusted\.Opaque") as info:
        ShardedAsyncCheckpointIO().load_checkpoint(ckpt)
    assert "trust_checkpoints=True" in str(info.value)
    loaded = ShardedAsyncCheckpointIO(trust_checkpoints=True).load_checkpoint(ckpt)
    assert loaded["callbacks"]["Mine"]["opaque"] == Opaque(7) and loaded["global_step"] == 3
    assert (
        ShardedAsyncCheckpointIO().load_checkpoint(ckpt, weights_only=False)["callbacks"]["Mine"]["opaque"].value == 7
    )
    code, _, err = _cli(capsys, "export", ckpt, str(tmp_path / "a.ckpt"))
    assert code == 1 and "test_untrusted.Opaque" in err
    code, out, _ = _cli(capsys, "export", ckpt, str(tmp_path / "b.ckpt"), "--trust")
    assert code == 0 and "exported step 3" in out
    assert torch.load(tmp_path / "b.ckpt", weights_only=False)["callbacks"]["Mine"]["opaque"] == Opaque(7)


def test_what_lightning_and_this_package_write_loads_without_trust(tmp_path: Path) -> None:
    from lightning.fabric.utilities.data import AttributeDict

    root = tmp_path / "ckpts"
    rng = np.random.RandomState(3).get_state()
    _save(root, [4], lightning_preempt={"rng": {"numpy": rng}, "x": np.float64(2.5)})
    loaded = ShardedAsyncCheckpointIO().load_checkpoint(str(root / checkpoint_name(4)))
    assert loaded["hyper_parameters"] == {"lr": 0.1, "layers": (1, 2)}
    assert np.array_equal(loaded["lightning_preempt"]["rng"]["numpy"][1], rng[1])
    assert loaded["lightning_preempt"]["x"] == 2.5
    torch.testing.assert_close(
        loaded["state_dict"]["weight"], lightning_like_checkpoint(step=4)["state_dict"]["weight"]
    )
    # a dict subclass is not something weights_only can build: named, and the opt-in works
    _save(root, [5], hparams=AttributeDict(lr=0.1))
    with pytest.raises(UntrustedCheckpointError, match="AttributeDict"):
        ShardedAsyncCheckpointIO().load_checkpoint(str(root / checkpoint_name(5)))
    assert (
        ShardedAsyncCheckpointIO(trust_checkpoints=True).load_checkpoint(str(root / checkpoint_name(5)))["hparams"].lr
    )


def test_a_dcp_metadata_payload_never_runs(tmp_path: Path, marker: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpts"
    _save(root, [5])
    ckpt = root / checkpoint_name(5)
    _replace_file(ckpt, ".metadata", pickle.dumps(Payload(marker)))
    with pytest.raises(UntrustedCheckpointError, match=r"builtins\.exec.*not one of DCP's metadata classes"):
        ShardedAsyncCheckpointIO().load_checkpoint(str(ckpt))
    code, _, err = _cli(capsys, "export", str(ckpt), str(tmp_path / "x.ckpt"), "--no-verify")
    assert code == 1 and "builtins.exec" in err
    code, _, err = _cli(capsys, "verify", str(ckpt))
    assert code == 1 and "builtins.exec" in err


def _metadata(ckpt: Path) -> Any:
    return unpickle_dcp_metadata((ckpt / ".metadata").read_bytes(), path=str(ckpt))


def test_dcp_byte_io_items_and_paths_out_of_the_checkpoint_are_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    root = tmp_path / "ckpts"
    _save(root, [6])
    ckpt = root / checkpoint_name(6)
    honest = (ckpt / ".metadata").read_bytes()
    md = _metadata(ckpt)
    md.state_dict_metadata["obj"] = BytesStorageMetadata()
    _replace_file(ckpt, ".metadata", pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match="byte-IO"):
        ShardedAsyncCheckpointIO().load_checkpoint(str(ckpt))

    (tmp_path / "outside.distcp").write_bytes(b"x" * 64)
    for bad in ("../../outside.distcp", "/etc/hostname", "__9_0.distcp"):
        md = unpickle_dcp_metadata(honest, path="x")
        info = next(iter(md.storage_data.values()))
        info.relative_path = bad
        _replace_file(ckpt, ".metadata", pickle.dumps(md))
        with pytest.raises(CorruptCheckpointError, match=r"our shard files|not listed in the manifest"):
            ShardedAsyncCheckpointIO().load_checkpoint(str(ckpt))
    md = unpickle_dcp_metadata(honest, path="x")
    next(iter(md.storage_data.values())).length = 1 << 40
    _replace_file(ckpt, ".metadata", pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match="beyond the end"):
        ShardedAsyncCheckpointIO().load_checkpoint(str(ckpt))


# ---- nothing outside the checkpoint is read -----------------------------------------------
@pytest.mark.parametrize("name", ["../x", "/etc/hostname", "/dev/zero", "a/../../x", "notes.txt", "state-rank0.pt"])
def test_manifest_file_names_must_be_ours(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1, 2])
    ckpt = root / checkpoint_name(2)
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    body["files"][name] = {"size": 5, "crc32c": "00000000"}
    _write_manifest(ckpt, body)
    with pytest.raises(CorruptCheckpointError, match="file name") as info:
        read_manifest(Store(str(ckpt)))
    assert "HINT:" in str(info.value)
    chosen = newest_valid(str(root), on_skip=lambda i, why: None)
    assert chosen is not None and chosen.step == 1  # a damaged newest one: resume falls back
    code, _, err = _cli(capsys, "verify", str(ckpt))
    assert code == 2 and "file name" in err
    code, out, _ = _cli(capsys, "ls", str(root))
    assert code == 0 and checkpoint_name(2) in out and checkpoint_name(1) in out


def test_a_symlinked_file_is_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1])
    ckpt = root / checkpoint_name(1)
    outside = tmp_path / "outside.pt"
    outside.write_bytes((ckpt / STATE).read_bytes())  # same bytes: size and CRC match
    (ckpt / STATE).unlink()
    (ckpt / STATE).symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        verify_checkpoint(Store(str(ckpt)))
    for io in (ShardedAsyncCheckpointIO(), ShardedAsyncCheckpointIO(verify_on_load=False)):
        with pytest.raises(CorruptCheckpointError, match="symbolic link"):
            io.load_checkpoint(str(ckpt))
    # a symlinked manifest is no commit either
    (ckpt / STATE).unlink()
    (ckpt / STATE).write_bytes(outside.read_bytes())
    (tmp_path / "m.json").write_bytes((ckpt / MANIFEST_NAME).read_bytes())
    (ckpt / MANIFEST_NAME).unlink()
    (ckpt / MANIFEST_NAME).symlink_to(tmp_path / "m.json")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        read_manifest(Store(str(ckpt)))


def test_a_symlinked_checkpoint_directory_is_not_listed_or_deleted(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _save(elsewhere, [1])
    root = tmp_path / "ckpts"
    _save(root, [5, 6])
    (root / checkpoint_name(2)).symlink_to(elsewhere / checkpoint_name(1), target_is_directory=True)
    assert [c.name for c in list_checkpoints(str(root))] == [checkpoint_name(6), checkpoint_name(5)]
    apply_retention(str(root), keep_last_n=1)
    assert (elsewhere / checkpoint_name(1) / MANIFEST_NAME).exists()


_RUN_CLI = [sys.executable, "-m", "lightning_preempt.cli"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifos_do_not_hang_ls_verify_or_load(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1, 2, 3])
    os.unlink(root / checkpoint_name(3) / MANIFEST_NAME)
    os.mkfifo(root / checkpoint_name(3) / MANIFEST_NAME)
    data = root / checkpoint_name(2) / STATE
    data.unlink()
    os.mkfifo(data)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    # a hang here is the bug: the timeout only keeps a regression from stalling the suite
    ls = subprocess.run([*_RUN_CLI, "ls", str(root)], capture_output=True, text=True, timeout=120, env=env)
    assert ls.returncode == 0, ls.stderr
    row3 = next(line for line in ls.stdout.splitlines() if checkpoint_name(3) in line)
    assert "FIFO" in row3 and " no " in row3
    verify = subprocess.run([*_RUN_CLI, "verify", str(root), "2"], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 2 and "FIFO" in verify.stderr and "HINT:" in verify.stderr
    for io in (ShardedAsyncCheckpointIO(), ShardedAsyncCheckpointIO(verify_on_load=False)):
        with pytest.raises(CorruptCheckpointError, match="FIFO"):
            io.load_checkpoint(str(root / checkpoint_name(2)))
    chosen = newest_valid(str(root), on_skip=lambda i, why: None)
    assert chosen is not None and chosen.step == 1


# ---- nothing that is not ours is deleted --------------------------------------------------
def test_retention_deletes_only_our_directories_with_only_our_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1, 2, 3, 4, 5])
    (root / "dataset").mkdir()
    (root / "dataset" / MANIFEST_NAME).write_text('{"rows": 3}')  # someone else's manifest
    (root / "dataset" / "rows.csv").write_text("a,b\n")
    (root / "notes-step3").mkdir()
    (root / "notes-step3" / "todo.txt").write_text("keep me")
    io = ShardedAsyncCheckpointIO()  # a Lightning-named checkpoint of ours (ModelCheckpoint)
    io.save_checkpoint(lightning_like_checkpoint(step=0), str(root / "epoch=0-step=0.ckpt"))
    io.teardown()
    (root / "README.txt").write_text("mine")
    (root / checkpoint_name(2) / "my-notes.txt").write_text("a user file inside one of ours")
    (root / checkpoint_name(0)).mkdir()  # an empty leftover of ours
    retention._WARNED_FOREIGN.discard(str(root))
    caplog.set_level(logging.INFO, logger="lightning_preempt")  # our logger propagates
    removed = apply_retention(str(root), keep_last_n=2)
    assert sorted(Path(p).name for p in removed) == [checkpoint_name(s) for s in (0, 1, 3)]
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["README.txt", "dataset", "notes-step3", "epoch=0-step=0.ckpt", *(checkpoint_name(s) for s in (2, 4, 5))]
    )
    assert (root / checkpoint_name(2) / "my-notes.txt").read_text() == "a user file inside one of ours"
    assert (root / "notes-step3" / "todo.txt").read_text() == "keep me"
    deleted = [r for r in caplog.records if r.levelno == logging.INFO and "deleted" in r.getMessage()]
    assert len(deleted) == 3
    assert "my-notes.txt" in caplog.text and "dataset" in caplog.text  # told, once
    assert ShardedAsyncCheckpointIO().load_checkpoint(str(root))["global_step"] == 5


def test_removing_a_directory_with_user_files_raises_with_a_hint(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1])
    ckpt = root / checkpoint_name(1)
    (ckpt / "precious.txt").write_text("x")
    with pytest.raises(CheckpointExistsError, match=r"precious\.txt") as info:
        ownership.remove_if_ours(Store(str(ckpt)), why="removal requested")
    assert "HINT:" in str(info.value)
    assert (ckpt / MANIFEST_NAME).exists() and (ckpt / "precious.txt").exists()


def test_saving_into_a_directory_with_user_files_is_refused_and_retention_spares_it(tmp_path: Path) -> None:
    root = tmp_path / "run"
    target = root / checkpoint_name(7)
    target.mkdir(parents=True)
    (target / "precious.txt").write_text("x")
    (target / "__0_0.distcp").write_bytes(b"stale bytes of ours")
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(step=7), str(target))
    with pytest.raises(CheckpointError, match=r"precious\.txt") as info:
        io.wait()  # refused: the directory is not ours to write into (issue 20)
    assert "\nHINT:" in str(info.value)
    io.teardown()
    assert (target / "precious.txt").read_text() == "x"  # nothing of it touched
    assert (target / "__0_0.distcp").read_bytes() == b"stale bytes of ours" and not (target / MANIFEST_NAME).exists()
    _save(root, [8, 9])
    removed = apply_retention(str(root), keep_last_n=1)
    assert sorted(Path(p).name for p in removed) == [checkpoint_name(8)]
    assert (target / "precious.txt").read_text() == "x"


def test_a_manifest_whose_step_disagrees_with_its_name_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1, 2, 3])
    _edit_manifest(root / checkpoint_name(1), step=999)  # would outrank, and prune, the real ones
    infos = {c.name: c for c in list_checkpoints(str(root))}
    assert not infos[checkpoint_name(1)].committed
    assert "step 999" in (infos[checkpoint_name(1)].problem or "")
    chosen = newest_valid(str(root), on_skip=lambda i, why: None)
    assert chosen is not None and chosen.step == 3
    apply_retention(str(root), keep_last_n=1)
    assert sorted(p.name for p in root.iterdir()) == [checkpoint_name(3)]  # the corrupt, older one went


def test_retention_never_counts_corrupt_ones_and_keeps_the_newest_that_verifies(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1, 2, 3, 4])
    shard = next((root / checkpoint_name(4)).glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a CRC check sees it
    shard.write_bytes(bytes(data))
    state = root / checkpoint_name(3) / STATE
    state.write_bytes(state.read_bytes()[:-10])
    verified._VERIFIED.clear()  # this process wrote them; the damage came later
    removed = apply_retention(str(root), keep_last_n=1)
    assert [Path(p).name for p in removed] == [checkpoint_name(1)]
    assert sorted(p.name for p in root.iterdir()) == [checkpoint_name(s) for s in (2, 3, 4)]
    assert ShardedAsyncCheckpointIO().load_checkpoint(str(root))["global_step"] == 2


def test_retention_spares_checkpoints_of_another_run(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1, 2, 3, 4, 5])
    for step in (1, 2):
        _edit_manifest(root / checkpoint_name(step), run_id="other-run")
    for step in (3, 4, 5):
        _edit_manifest(root / checkpoint_name(step), run_id="this-run")
    removed = apply_retention(str(root), keep_last_n=1, run_id="this-run")
    assert sorted(Path(p).name for p in removed) == [checkpoint_name(3), checkpoint_name(4)]
    assert sorted(p.name for p in root.iterdir()) == [checkpoint_name(s) for s in (1, 2, 5)]


def test_the_writer_records_a_run_id(memory_url: str) -> None:
    url = f"{memory_url}/{checkpoint_name(1)}"
    request = SaveRequest(url=url, tensors={"w": torch.ones(3)}, skeleton=b"x", step=1, epoch=0, run_id="run-7")
    assert write_checkpoint(request).run_id == "run-7"
    assert read_manifest(Store(url)).run_id == "run-7"
    honest = Manifest(step=1, epoch=0, world_size=1, files={})
    assert b"run_id" not in honest.to_json()  # absent unless given


# ---- odd manifest fields --------------------------------------------------------------------
def _body() -> dict[str, Any]:
    return json.loads(Manifest(step=3, epoch=0, world_size=1, files={".metadata": _entry()}).to_json())


def _entry() -> Any:
    from lightning_preempt.format.manifest import FileEntry

    return FileEntry(10, "0a0b0c0d")


@pytest.mark.parametrize(
    "edit",
    [
        {"version": 0},
        {"version": "1"},
        {"version": "garbage"},
        {"version": True},
        {"version": 1.0},
        {"step": 3.7},
        {"step": "3"},
        {"step": True},
        {"world_size": 0},
        {"created_unix": 1e300},
        {"created_unix": -5},
        {"created_unix": "today"},
        {"stats": {"write_s": 1e400}},
        {"stats": {"write_s": "fast"}},
        {"files": {".metadata": {"size": -1, "crc32c": "0a0b0c0d"}}},
        {"files": {".metadata": {"size": 1.5, "crc32c": "0a0b0c0d"}}},
        {"files": {".metadata": {"size": 1, "crc32c": "XYZ"}}},
        {"files": {".metadata": {"size": 1, "crc32c": "0a0b0c0d", "path": "/etc"}}},
        {"files": []},
        {"extra": "x"},
        {"run_id": 5},
        {"run_id": ""},
        {"surprise": 1},
    ],
    ids=lambda e: json.dumps(e)[:40],
)
def test_odd_manifest_fields_are_corrupt_not_newer(edit: dict[str, Any]) -> None:
    data = json.dumps({**_body(), **edit}).encode()
    with pytest.raises(CorruptCheckpointError) as info:
        Manifest.from_json(data, path="gs://b/run/step-3")
    assert not isinstance(info.value, UnsupportedFormatError) and "HINT:" in str(info.value)


@pytest.mark.parametrize("raw", [b'"created_unix": NaN', b'"created_unix": Infinity'])
def test_non_finite_json_numbers_are_corrupt(raw: bytes) -> None:
    body = _body()
    data = json.dumps(body).encode().replace(b'"created_unix": ' + json.dumps(body["created_unix"]).encode(), raw)
    assert raw in data
    with pytest.raises(CorruptCheckpointError, match=r"NaN|Infinity"):
        Manifest.from_json(data, path="x")


def test_odd_fields_end_to_end_ls_plan_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpts"
    _save(root, [1, 2, 3, 4])
    body = json.loads((root / checkpoint_name(2) / MANIFEST_NAME).read_text())
    raw = json.dumps(body).replace(json.dumps(body["created_unix"]), "NaN", 1).encode()
    _write_manifest(root / checkpoint_name(2), None, raw)
    _edit_manifest(root / checkpoint_name(3), stats={"write_s": 1e308, "blocking_s": -1e308})
    _edit_manifest(root / checkpoint_name(4), version="1")
    code, out, err = _cli(capsys, "ls", str(root))
    assert code == 0 and "Traceback" not in err and out.count(" no ") == 3  # steps 4, 3, 2: not committed
    code, _, err = _cli(capsys, "plan", "--from", str(root / checkpoint_name(3)), "--mtbf", "4h")
    assert code == 2 and "stats" in err and "Traceback" not in err
    # version "1" is damage, not a newer format: resume falls back instead of stopping
    chosen = newest_valid(str(root), on_skip=lambda i, why: None)
    assert chosen is not None and chosen.step == 1
    assert ShardedAsyncCheckpointIO().load_checkpoint(str(root))["global_step"] == 1


# ---- map_location -----------------------------------------------------------------------------
def test_map_location_is_honoured(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _save(root, [2])
    ckpt = str(root / checkpoint_name(2))
    for where in ("meta", torch.device("meta"), {"cpu": "meta"}):
        loaded = ShardedAsyncCheckpointIO().load_checkpoint(ckpt, map_location=where)
        assert loaded["state_dict"]["weight"].device.type == "meta", where
        assert loaded["rng"].device.type == "meta" and loaded["global_step"] == 2
    loaded = ShardedAsyncCheckpointIO().load_checkpoint(ckpt, map_location=lambda storage, loc: storage)
    torch.testing.assert_close(
        loaded["state_dict"]["weight"], lightning_like_checkpoint(step=2)["state_dict"]["weight"]
    )


# ---- no side effects on object stores --------------------------------------------------------
def test_writing_to_a_missing_s3_bucket_fails_with_a_hint_and_creates_nothing(tmp_path: Path) -> None:
    import fsspec
    from servers import start_s3

    server = start_s3()
    try:
        fs = fsspec.filesystem("s3", **server.storage_options)
        before = sorted(fs.ls(""))
        io = ShardedAsyncCheckpointIO(storage_options=server.storage_options)
        with pytest.raises(CheckpointError) as info:
            io.save_checkpoint(lightning_like_checkpoint(step=1), f"s3://missing-bucket/run/{checkpoint_name(1)}")
            io.wait()
        io.teardown()
        assert isinstance(info.value, CheckpointWriteError)
        assert "missing-bucket" in str(info.value) and "never creates buckets" in str(info.value)
        fs.invalidate_cache()
        assert sorted(fs.ls("")) == before and not any("missing-bucket" in b for b in fs.ls(""))
        # the DCP writer alone (what a save does after the path check) creates nothing either
        from lightning_preempt.write.dcp_writer import ChecksummingWriter

        writer = ChecksummingWriter(Store(f"s3://missing-bucket/x/{checkpoint_name(2)}", server.storage_options))
        with pytest.raises(CheckpointWriteError, match="never creates buckets"):
            writer.fs.mkdir(writer.path)
        fs.invalidate_cache()
        assert sorted(fs.ls("")) == before
    finally:
        server.stop()


def test_cli_credential_hints_never_suggest_secrets_on_the_command_line() -> None:
    class NoCredentialsError(Exception):
        pass

    for url in ("s3://b/run", "gs://b/run"):
        hint = storage_hint(url, NoCredentialsError("Unable to locate credentials"))
        assert "secret=" not in hint and "key=" not in hint and "token=PATH" not in hint
    assert "AWS_PROFILE" in storage_hint("s3://b/r", NoCredentialsError("Unable to locate credentials"))
    assert "ps" in build_parser()._subparsers._group_actions[0].choices["ls"].format_help()  # type: ignore[union-attr]


def test_draining_a_crafted_checkpoint_writes_nothing_outside_the_destination(tmp_path: Path) -> None:
    from lightning_preempt.tiers.drain import drain_checkpoint

    src_root = tmp_path / "bucket"
    _save(src_root, [1])
    src = src_root / checkpoint_name(1)
    (tmp_path / "escaped").write_bytes(b"attacker")  # what a "../../escaped" entry would be
    body = json.loads((src / MANIFEST_NAME).read_text())
    body["files"]["../../escaped"] = {"size": 8, "crc32c": "00000000"}
    _write_manifest(src, body)
    dst = tmp_path / "local" / "node" / checkpoint_name(1)
    with pytest.raises(CorruptCheckpointError, match="file name"):
        drain_checkpoint(Store(str(src)), Store(str(dst)))
    assert not (tmp_path / "local" / "escaped").exists() and not (dst / MANIFEST_NAME).exists()
