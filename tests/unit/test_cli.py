"""``lightning-preempt`` on checkpoints written by a real ``trainer.fit``.

A few commands run as a user runs them (``python -m lightning_preempt.cli`` in a
subprocess); the many error cases call ``lightning_preempt.cli.main`` in-process, which is the same code
without paying the interpreter and Lightning start-up each time.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_preempt.cli.app import main as cli_main
from lightning_preempt.cli.export import pickled_globals
from lightning_preempt.cli.options import parse_storage_options
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.storage.diagnose import storage_hint
from lightning_preempt.storage.store import Store

ROOT = Path(__file__).resolve().parents[2]

# The model lives in its own file so the "plain Lightning" subprocess can import it
# without importing lightning_preempt (or this test module, which does).
MODEL_SRC = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning as L


    class CliModel(L.LightningModule):
        def __init__(self, width: int = 16, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


    def loader() -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).tanh()), batch_size=8)


    def trainer_kwargs(max_steps: int) -> dict:
        return dict(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
    """
)

STEPS = (4, 8, 12)
MAX_STEPS = 12


def _name(step: int) -> str:
    return f"step-{step:010d}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints at steps 4, 8 and 12 of one real ``trainer.fit``."""
    import lightning as L

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    base = tmp_path_factory.mktemp("cli")
    (base / "cli_model.py").write_text(MODEL_SRC)
    sys.path.insert(0, str(base))
    try:
        mod = importlib.import_module("cli_model")
    finally:
        sys.path.remove(str(base))
    root = base / "ckpts"
    L.seed_everything(0)
    callback = PreemptionCallback(str(root), every_n_train_steps=4, keep_last_n=5)
    trainer = L.Trainer(callbacks=[callback], plugins=[ShardedAsyncCheckpointIO()], **mod.trainer_kwargs(MAX_STEPS))
    trainer.fit(mod.CliModel(), mod.loader())
    # (.lp-* files: the run's lease, lease.py)
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".lp-")) == [_name(s) for s in STEPS]
    sys.modules.pop("cli_model", None)
    return {"base": base, "root": str(root)}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_preempt.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        check=False,
    )


def call(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``lightning_preempt.cli.main`` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = cli_main(list(args))
    except SystemExit as exit_:  # argparse usage errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def damaged(trained: dict[str, Any], tmp_path: Path) -> Path:
    """A private copy of the checkpoint root, free to corrupt."""
    copy = tmp_path / "ckpts"
    shutil.copytree(trained["root"], copy)
    return copy


# ---- as a user runs it ---------------------------------------------------------------------
def test_ls_lists_every_step_newest_first(trained: dict[str, Any]) -> None:
    result = run_cli("ls", trained["root"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["STEP", "EPOCH", "CREATED"]
    assert [int(line.split()[0]) for line in lines[1:]] == sorted(STEPS, reverse=True)
    for line in lines[1:]:
        assert "primary" in line and " yes " in line and line.split()[-1].startswith("step-")


def test_verify_subprocess_flipped_byte(damaged: Path) -> None:
    _flip_byte(damaged / _name(MAX_STEPS))
    result = run_cli("verify", str(damaged), str(MAX_STEPS))
    assert result.returncode == 2
    assert "INVALID" in result.stderr and "CRC32C" in result.stderr and "HINT:" in result.stderr


def test_export_loads_in_plain_lightning_without_this_package(trained: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "exported" / "model.ckpt"
    result = run_cli("export", trained["root"], str(MAX_STEPS), str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file() and f"exported step {MAX_STEPS}" in result.stdout
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]

    # Nothing in the pickle refers to lightning_preempt ...
    assert not [g for g in pickled_globals(str(out)) if g.startswith("lightning_preempt")]
    # ... and it is the same checkpoint, tensor for tensor.
    reference = load_full_checkpoint(Store(f"{trained['root']}/{_name(MAX_STEPS)}"))
    exported = torch.load(out, map_location="cpu", weights_only=False)
    _assert_same(exported, reference, numpy_as_lists=True)
    assert exported["callbacks"] == reference["callbacks"]
    # Lightning >= 2.6 load_from_checkpoint uses weights_only=True: no NumPy arrays left
    torch.load(out, map_location="cpu", weights_only=True)
    assert "note:" not in result.stderr

    ref_path = tmp_path / "reference_state.pt"
    torch.save(dict(reference["state_dict"]), ref_path)
    script = tmp_path / "plain_load.py"
    script.write_text(PLAIN_LOAD_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(trained["base"]), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-I", str(script), str(out), str(ref_path), str(MAX_STEPS + 4)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "lightning_preempt_importable": False,
        "weights_equal": True,
        "hparams": {"width": 16, "lr": 0.05},
        "resumed_at_step": MAX_STEPS,
        "weights_at_resume_equal": True,
        "final_step": MAX_STEPS + 4,
    }


PLAIN_LOAD_SCRIPT = """
import json, sys
sys.path.insert(0, __import__("os").environ["PYTHONPATH"])  # -I ignores PYTHONPATH
sys.modules["lightning_preempt"] = None  # any reference to the package now fails to unpickle
try:
    import lightning_preempt  # noqa: F401
    importable = True
except ImportError:
    importable = False

import torch
import lightning as L
from cli_model import CliModel, loader, trainer_kwargs

ckpt, ref_path, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
reference = torch.load(ref_path, weights_only=True)

model = CliModel.load_from_checkpoint(ckpt)
weights_equal = all(torch.equal(v, reference[k]) for k, v in model.state_dict().items()) and set(
    model.state_dict()) == set(reference)


class Probe(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.equal = all(torch.equal(v, reference[k]) for k, v in pl_module.state_dict().items())


probe = Probe()
trainer = L.Trainer(callbacks=[probe], enable_checkpointing=False, **trainer_kwargs(max_steps))
trainer.fit(CliModel(), loader(), ckpt_path=ckpt)
assert not any(k.startswith("lightning_preempt") and m is not None for k, m in sys.modules.items())
print(json.dumps({
    "lightning_preempt_importable": importable,
    "weights_equal": weights_equal,
    "hparams": dict(model.hparams),
    "resumed_at_step": probe.step,
    "weights_at_resume_equal": probe.equal,
    "final_step": trainer.global_step,
}))
"""


def test_plan_subprocess_json_matches_young_daly() -> None:
    result = run_cli(
        "plan", "--state-bytes", "1.5GB", "--write-bandwidth", "2GB/s", "--mtbf", "4.5h", "--blocking", "0.15",
        "--step-time", "0.5", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    c, m = 0.15, 4.5 * 3600
    young = (2 * c * m) ** 0.5
    daly = young * (1 + (c / (2 * m)) ** 0.5 / 3 + c / (18 * m)) - c
    assert body["inputs"] == {
        "state_bytes": 1_500_000_000,
        "write_bandwidth": 2e9,
        "mtbf_s": m,
        "blocking_s": c,
        "grace_s": 30.0,
        "restart_s": 0.0,
        "step_time_s": 0.5,
        "margin_s": None,
    }
    assert body["young_s"] == pytest.approx(young) and body["daly_s"] == pytest.approx(daly)
    assert body["interval_s"] == pytest.approx(daly) and body["interval_steps"] == int(daly // 0.5)
    assert body["flush_s"] == pytest.approx(0.75) and body["snapshot_fits"] is True
    assert body["lost_hard_kill"] == pytest.approx(c / daly + daly / 2 / m)
    assert body["sources"]["blocking_s"] == "--blocking"


# ---- ls ------------------------------------------------------------------------------------
def test_ls_json_and_verify(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "ls", trained["root"], "--json", "--verify")
    assert code == 0
    rows = json.loads(out)
    assert [r["step"] for r in rows] == sorted(STEPS, reverse=True)
    for row in rows:
        assert row["committed"] and row["verified"] and row["verify_error"] is None
        assert row["tier"] == "primary" and row["world_size"] == 1 and row["size_bytes"] > 0
        assert row["created_utc"].endswith("Z") and row["name"] == _name(row["step"])


def test_ls_verify_shows_the_reason(damaged: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip_byte(damaged / _name(8))
    (damaged / _name(16)).mkdir()  # a partial save: no manifest
    code, out, _ = call(capsys, "ls", str(damaged), "--verify")
    assert code == 0
    lines = {int(line.split()[0]): line for line in out.strip().splitlines()[1:]}
    assert set(lines) == {16, 12, 8, 4}
    assert lines[12].rstrip().endswith(" ok") and lines[4].rstrip().endswith(" ok")
    assert "fails its CRC32C check" in lines[8]
    assert " no " in lines[16] and "no manifest" in lines[16]


def test_ls_on_one_checkpoint_dir(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "ls", f"{trained['root']}/{_name(8)}", "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [8]


def test_no_checkpoints_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for url in (str(tmp_path), str(tmp_path / "missing")):
        for command in (["ls", url], ["verify", url], ["export", url, str(tmp_path / "x.ckpt")]):
            code, _, err = call(capsys, *command)
            assert code == 1, command
            assert ("has no checkpoints" in err or "does not exist" in err) and "HINT:" in err


# ---- verify --------------------------------------------------------------------------------
def _flip_byte(ckpt: Path) -> None:
    shard = next(ckpt.glob("__*_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    state = ckpt / "state-rank00000.pt"
    state.write_bytes(state.read_bytes()[:-7])


def _remove_metadata(ckpt: Path) -> None:
    (ckpt / ".metadata").unlink()


def _garbage_manifest(ckpt: Path) -> None:
    (ckpt / "manifest.json").write_bytes(b"\x00{not json")


def _manifest_v999(ckpt: Path) -> None:
    body = json.loads((ckpt / "manifest.json").read_text())
    body["version"] = 999
    (ckpt / "manifest.json").write_text(json.dumps(body))


def _no_manifest(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()


@pytest.mark.parametrize(
    ("damage", "code", "message"),
    [
        (_flip_byte, 2, "fails its CRC32C check"),
        (_truncate, 2, "truncated"),
        (_remove_metadata, 2, "'.metadata' listed in the manifest is missing"),
        (_garbage_manifest, 2, "manifest is not valid JSON"),
        (_manifest_v999, 1, "manifest format version 999 is not supported"),
        (_no_manifest, 1, "manifest.json is missing"),
    ],
    ids=["flipped-byte", "truncated", "missing-file", "garbage-manifest", "version-999", "missing-manifest"],
)
def test_verify_catches_corruption(
    damaged: Path, capsys: pytest.CaptureFixture[str], damage: Any, code: int, message: str
) -> None:
    ckpt = damaged / _name(8)
    damage(ckpt)
    for target in (["verify", str(damaged), "8"], ["verify", str(ckpt)]):
        got, out, err = call(capsys, *target)
        assert got == code, (target, out, err)
        assert message in err and "HINT:" in err and out == ""
    # the neighbours are unaffected
    got, out, _ = call(capsys, "verify", str(damaged), "4")
    assert got == 0 and out.startswith("OK step 4 ")


def test_verify_ok(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(capsys, "verify", trained["root"])
    assert code == 0 and err == ""
    assert out.startswith(f"OK step {MAX_STEPS} ") and "sizes and CRC32C match" in out
    code, out, _ = call(capsys, "verify", f"{trained['root']}/{_name(4)}", "--json")
    assert code == 0 and json.loads(out)["ok"] is True and json.loads(out)["step"] == 4


def test_verify_default_is_newest_committed(damaged: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (damaged / _name(20)).mkdir()  # newer, uncommitted: skipped with a note
    code, out, err = call(capsys, "verify", str(damaged))
    assert code == 0 and out.startswith(f"OK step {MAX_STEPS} ")
    assert f"skipping newer {_name(20)}" in err
    code, _, err = call(capsys, "verify", str(damaged), "20")
    assert code == 1 and "not committed" in err
    code, _, err = call(capsys, "verify", str(damaged), "5")
    assert code == 1 and "no checkpoint of step 5" in err and "12, 8, 4" in err


def test_verify_progress_bar(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = call(capsys, "verify", trained["root"], "--progress")
    assert code == 0 and "100.0%" in err and "verifying step 12" in err


def test_usage_errors_exit_1(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = call(capsys, "verify", trained["root"], "not-a-step")
    assert code == 1 and "invalid int value" in err
    code, _, err = call(capsys, "export", trained["root"])
    assert code == 1 and "URL [STEP] OUT.ckpt" in err
    code, _, err = call(capsys, "plan", "--state-bytes", "3 bananas", "--mtbf", "1h")
    assert code == 1 and "cannot read a size" in err
    code, _, err = call(capsys, "ls", trained["root"], "-o", "novalue")
    assert code == 1 and "KEY=VALUE" in err


# ---- storage errors ------------------------------------------------------------------------
def test_unreachable_storage_names_what_to_set(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = call(capsys, "ls", "nosuchprotocol://bucket/run")
    assert code == 1 and "Protocol not known" in err and "HINT:" in err


def test_storage_error_hints() -> None:
    class NoCredentialsError(Exception):
        pass

    hint = storage_hint("s3://bucket/run", NoCredentialsError("Unable to locate credentials"))
    assert "AWS_ACCESS_KEY_ID" in hint
    hint = storage_hint("gs://bucket/run", OSError("Cannot connect to host storage.googleapis.com"))
    assert "cannot be reached" in hint and "GOOGLE_APPLICATION_CREDENTIALS" in hint
    assert "pip install 'lightning_preempt[gcs]'" in storage_hint("gs://b/r", ImportError("Install gcsfs"))


def test_storage_options_parse() -> None:
    assert parse_storage_options(["anon=true", "client_kwargs.region_name=eu-west-1", "n=3", "s=abc"]) == {
        "anon": True,
        "client_kwargs": {"region_name": "eu-west-1"},
        "n": 3,
        "s": "abc",
    }


def test_storage_options_reach_the_store(trained: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "ls", trained["root"], "-o", "auto_mkdir=true", "--json")
    assert code == 0 and len(json.loads(out)) == len(STEPS)


# ---- export --------------------------------------------------------------------------------
def test_export_refuses_to_overwrite(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.ckpt"
    out.write_bytes(b"precious")
    code, _, err = call(capsys, "export", trained["root"], str(out))
    assert code == 1 and "--force" in err and out.read_bytes() == b"precious"
    code, stdout, _ = call(capsys, "export", trained["root"], "4", str(out), "--force")
    assert code == 0 and "exported step 4" in stdout
    assert torch.load(out, weights_only=False)["global_step"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]  # no temp file left


def test_export_refuses_a_corrupt_checkpoint(damaged: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip_byte(damaged / _name(MAX_STEPS))
    out = tmp_path / "bad.ckpt"
    code, _, err = call(capsys, "export", str(damaged), str(out))
    assert code == 2 and "CRC32C" in err and not out.exists()


def test_export_refuses_state_that_needs_this_package(
    trained: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_preempt.cli import export
    from lightning_preempt.format import TensorRef

    real = export.load_full_checkpoint

    def leaky(store: Store, **kwargs: Any) -> dict[str, Any]:
        checkpoint = real(store, **kwargs)
        checkpoint["callbacks"]["SomeCallback"] = {"ref": TensorRef("state_dict/x")}
        return checkpoint

    monkeypatch.setattr(export, "load_full_checkpoint", leaky)
    out = tmp_path / "leaky.ckpt"
    with pytest.raises(export.ExportError, match=r"lightning_preempt\.format\.TensorRef") as info:
        export.export_checkpoint(Store(trained["root"] + "/" + _name(4)), str(out))
    assert "HINT:" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_pickle_globals_sees_both_opcodes() -> None:
    import pickle

    from lightning_preempt.cli.export import pickle_globals, plain_numpy
    from lightning_preempt.format import TensorRef

    for protocol in (2, 4, 5):  # GLOBAL, then STACK_GLOBAL with memoised strings
        data = pickle.dumps({"a": [TensorRef("k"), TensorRef("j")], "b": Path("x")}, protocol=protocol)
        found = pickle_globals(data)
        assert "lightning_preempt.format.TensorRef" in found, (protocol, found)
    np = pytest.importorskip("numpy")
    assert plain_numpy({"rng": ("MT19937", np.arange(3, dtype=np.uint32), np.int64(5))}) == {
        "rng": ("MT19937", [0, 1, 2], 5)
    }


# ---- plan ----------------------------------------------------------------------------------
def test_plan_text_shows_every_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "plan", "--state-bytes", "840GiB", "--write-bandwidth", "500MB/s", "--mtbf", "30m")
    assert code == 0
    for text in ("state size", "write bandwidth", "blocking per save", "ESTIMATE", "MTBF", "grace period",
                 "sqrt(2CM)", "clamped to F", "DOES NOT FIT", "hard kill", "HINT:"):  # fmt: skip
        assert text in out, text


def test_plan_from_checkpoint_and_measured_bandwidth(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = call(
        capsys, "plan", "--from", trained["root"], "--mtbf", "2h", "--measure-dir", str(tmp_path),
        "--measure-bytes", "4MiB", "--json",
    )  # fmt: skip
    assert code == 0
    body = json.loads(out)
    manifest = json.loads((Path(trained["root"]) / _name(MAX_STEPS) / "manifest.json").read_text())
    assert body["inputs"]["state_bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert body["inputs"]["blocking_s"] == pytest.approx(manifest["stats"]["blocking_s"])
    assert body["sources"]["write_bandwidth"].startswith("measured")
    assert body["inputs"]["write_bandwidth"] > 0
    assert list(tmp_path.iterdir()) == []  # the measurement file is gone


def _assert_same(a: Any, b: Any, where: str = "", numpy_as_lists: bool = False) -> None:
    """Deep equality with ``torch.equal`` for tensors (same dtype, shape and values); with
    ``numpy_as_lists`` a NumPy value in ``b`` may be a list or number in ``a`` (export)."""
    if numpy_as_lists and type(b).__module__ == "numpy":
        assert a == b.tolist(), where
    elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}", numpy_as_lists)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}", numpy_as_lists)
    elif type(a).__module__ == "numpy":
        assert (a == b).all(), where
    else:
        assert a == b, where


def test_the_cli_reads_checkpoints_without_importing_lightning() -> None:
    code = (
        "import sys, lightning_preempt.cli, lightning_preempt.read.load\n"
        "assert not any(m == 'lightning' or m.startswith('lightning.') for m in sys.modules), 'Lightning imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
