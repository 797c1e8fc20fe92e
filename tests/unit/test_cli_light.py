"""``lightning-preempt ls``, ``verify``, ``plan`` and ``report`` import neither torch nor Lightning.

Each runs in a fresh interpreter, which then reports what it imported. ``verify`` still
checks that the state loads without ``trust_checkpoints`` (format/pickles/check.py walks the
pickles instead of unpickling them), so a payload is still refused.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.storage.checksum import Crc32c

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")

#: Runs each argv through the CLI in one fresh interpreter; prints what each imported.
RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from lightning_preempt.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in json.loads(sys.argv[2]))
        results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy})
    print(json.dumps(results))
    """
)


def run_fresh(*argvs: list[str]) -> list[dict[str, Any]]:
    """Every argv through ``lightning_preempt.cli.main`` in one new interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(argvs), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


class Payload:
    """Unpickling it would run ``exec``."""

    def __reduce__(self) -> Any:
        return (exec, ("raise SystemExit('code from the checkpoint ran')",))


def _poison(ckpt: Path) -> None:
    """Put a payload into the per-rank state and fix its size and CRC32C in the manifest."""
    state = ckpt / "state-rank00000.pt"
    skeleton = torch.load(state, weights_only=False)  # our own honest file
    skeleton["callbacks"] = {"Evil": Payload()}
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    state.write_bytes(buf.getvalue())
    crc = Crc32c()
    crc.update(buf.getvalue())
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    body["files"][state.name] = {"size": len(buf.getvalue()), "crc32c": crc.hexdigest()}
    (ckpt / MANIFEST_NAME).unlink()
    (ckpt / MANIFEST_NAME).write_text(json.dumps(body))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 written by the plugin; step 3 carries a payload in its state."""
    root = tmp_path_factory.mktemp("light") / "ckpts"
    io_ = ShardedAsyncCheckpointIO()
    for step in (1, 2, 3):
        model = torch.nn.Linear(4, 3)
        ckpt = {"epoch": 0, "global_step": step, "state_dict": model.state_dict(), "callbacks": {"Cb": {"best": 0.5}}}
        io_.save_checkpoint(ckpt, str(root / checkpoint_name(step)))
    io_.teardown()
    _poison(root / checkpoint_name(3))
    return root


def test_ls_verify_plan_and_report_import_neither_torch_nor_lightning(root: Path) -> None:
    results = run_fresh(
        ["ls", str(root)],
        ["ls", str(root), "--json", "--verify"],
        ["verify", str(root), "2"],
        ["verify", str(root / checkpoint_name(1)), "--json"],
        ["plan", "--from", str(root), "--mtbf", "2h", "--write-bandwidth", "1GB/s", "--json"],
        ["plan", "--state-bytes", "1.5GB", "--write-bandwidth", "2GB/s", "--mtbf", "4.5h"],
        ["report", str(root), "--json"],
    )
    for result in results:
        assert result["code"] == 0, result
        assert result["heavy"] == [], result  # what the command imported
    ls, ls_json, verify, verify_json, plan_from, plan, report = results
    assert [line.split()[0] for line in ls["out"].splitlines()[1:]] == ["3", "2", "1"]
    assert all(row["verified"] for row in json.loads(ls_json["out"]))  # sizes and CRC32C: the payload's were fixed
    assert verify["out"].startswith("OK step 2 ") and "loads without trust_checkpoints" in verify["out"]
    assert json.loads(verify_json["out"])["ok"] is True
    assert json.loads(plan_from["out"])["sources"]["state_bytes"].startswith("size of step 3")
    assert "recommended" in plan["out"]
    # no ledger (the plugin alone wrote these): the report falls back to the manifests, and says so
    assert json.loads(report["out"])["source"] == "manifests" and json.loads(report["out"])["steps"] == [1, 2, 3]
    assert "no goodput ledger" in report["err"]


def test_verify_refuses_a_payload_without_torch(root: Path) -> None:
    (refused,) = run_fresh(["verify", str(root)])
    assert refused["code"] == 1 and refused["out"] == "" and refused["heavy"] == []
    assert "step 3: sizes and CRC32C match, but refusing to unpickle" in refused["err"]
    assert "builtins.exec" in refused["err"] and "HINT:" in refused["err"]


def test_export_is_the_command_that_imports_torch(root: Path, tmp_path: Path) -> None:
    (exported,) = run_fresh(["export", str(root), "2", str(tmp_path / "model.ckpt")])
    assert exported["code"] == 0, exported["err"]
    assert "torch" in exported["heavy"] and "lightning" not in exported["heavy"]
