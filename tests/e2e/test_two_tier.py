"""Two-tier mode: commit to node-local disk, drain to gs:// (GCS emulator) / s3:// (moto).

Real ``trainer.fit`` runs against real servers on 127.0.0.1: periodic saves drained to the
bucket, SIGTERM (a subprocess), resume from the bucket on a "new node" (empty local tier),
resume from the local tier when it is newer (and its upload on start), and a server killed
mid-upload leaving no committed remote checkpoint while training goes on.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import pytest
import servers
import torch
from ckpts import committed
from jobs import launch
from lightning.pytorch.callbacks import Callback
from trainers import Fit, fit

from lightning_preempt import Tuning
from lightning_preempt.catalog.ownership import remove_if_ours
from lightning_preempt.format.names import MANIFEST_NAME, writer_of
from lightning_preempt.storage.diagnose import redact
from lightning_preempt.storage.store import Store

if TYPE_CHECKING:
    from objectstore_plugin import Remote

pytest_plugins = ["objectstore_plugin"]
pytestmark = [pytest.mark.objectstore, pytest.mark.timeout(180)]


def _fit(remote_url: str, options: dict[str, Any], local: Path, max_steps: int, seed: int, **kw: Any) -> Fit:
    """Two tiers: every 3 steps to ``local``, drained to ``remote_url``; 2 kept per tier."""
    return fit(
        remote_url, max_steps, seed=seed, every=3, keep_last_n=2, storage_options=options, local_dirpath=local, **kw
    )


def _name(step: int) -> str:
    return f"step-{step:010d}"


def test_periodic_saves_drain_and_resume_from_remote_on_a_new_node(tmp_path: Path, remote: Remote) -> None:
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    first = _fit(remote.url, remote.storage_options, node_a, max_steps=6, seed=0)
    io = first.io
    weights_at_6 = {k: v.clone() for k, v in first.model.state_dict().items()}
    # Both tiers hold the same committed checkpoints (per-tier retention keeps 2).
    assert committed(str(node_a)) == [6, 3]
    assert committed(remote.url, remote.storage_options) == [6, 3]
    assert io.tiers is not None
    assert [(d.step, d.error) for d in io.tiers.drains if d.skipped is None] == [(3, None), (6, None)]
    for step in (3, 6):  # byte-identical manifests: the remote copy is the local one, drained
        local = Store(str(node_a / _name(step))).read_bytes(MANIFEST_NAME)
        assert Store(remote.join(_name(step)), remote.storage_options).read_bytes(MANIFEST_NAME) == local

    # A new node: its local tier is empty; resume comes from the bucket.
    second = _fit(remote.url, remote.storage_options, node_b, max_steps=9, seed=123)
    assert second.callback.resumed_from == remote.join(_name(6))
    assert second.probe.start_step == 6
    for k, v in weights_at_6.items():
        assert torch.equal(second.probe.start_weights[k], v), k
    assert committed(str(node_b)) == [9]
    assert committed(remote.url, remote.storage_options) == [9, 6]


def test_resume_prefers_local_and_uploads_local_only_checkpoints_on_start(tmp_path: Path, gs_remote: Remote) -> None:
    remote, local = gs_remote, tmp_path / "node"
    _fit(remote.url, remote.storage_options, local, max_steps=6, seed=0)
    # Same step on both tiers: local wins the tie (no download).
    run = _fit(remote.url, remote.storage_options, local, max_steps=7, seed=1)
    assert run.callback.resumed_from == str(local / _name(6)) and run.probe.start_step == 6
    assert committed(remote.url, remote.storage_options) == [7, 6]

    # The bucket lost step 7 (it was never uploaded: e.g. preempted mid-drain): local is newer.
    remove_if_ours(Store(remote.join(_name(7)), remote.storage_options), why="removal requested")
    assert committed(remote.url, remote.storage_options) == [6]
    run = _fit(remote.url, remote.storage_options, local, max_steps=9, seed=2)
    assert run.callback.resumed_from == str(local / _name(7)) and run.probe.start_step == 7
    assert run.io.tiers is not None
    assert [d.step for d in run.io.tiers.drains if d.skipped is None and d.error is None][:1] == [7]  # on start, first
    # Uploaded before retention pruned the bucket: step 6 went, 7 and 9 stay.
    assert committed(remote.url, remote.storage_options) == [9, 7]
    assert committed(str(local)) == [9, 7]


def test_sigterm_snapshot_commits_locally_then_drains(tmp_path: Path, s3_remote: Remote) -> None:
    remote = s3_remote
    status, local = tmp_path / "status", tmp_path / "node-a"
    argv = [
        "--dirpath", remote.url, "--status", str(status),
        "--local-dirpath", str(local), "--storage-options", json.dumps(remote.storage_options),
        "--every", "5", "--max-steps", "30", "--signal-at", "step:7",
    ]  # fmt: skip
    proc = launch("train_script.py", tmp_path, *argv)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    exit_line = next(line for line in out.splitlines() if "exiting with code 143" in line)
    assert f"local ({local / _name(7)})" in exit_line and f"remote ({remote.join(_name(7))})" in exit_line
    assert committed(str(local)) == [7, 5]
    assert committed(remote.url, remote.storage_options) == [7, 5]
    for secret in ("x", "y"):  # the dummy keys are too short to grep; the real ones are redacted
        assert f"'secret': '{secret}'" not in out

    # The job is requeued on another node: empty local tier, resume from the bucket.
    shutil.rmtree(local)
    argv2 = [a if a != "30" else "9" for a in argv[: argv.index("--signal-at")]]
    argv2[argv2.index(str(local))] = str(tmp_path / "node-b")
    proc = launch("train_script.py", tmp_path, *argv2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    result = json.loads((status / "rank0.result.json").read_text())
    assert result["resumed_from"] == remote.join(_name(7)) and result["start_step"] == 7 and result["step"] == 9


def test_server_killed_mid_upload_leaves_no_remote_commit_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = servers.start_s3()
    local = tmp_path / "node"
    options = {
        **server.storage_options,
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5},
    }
    url = server.url("run")
    commits: list[str] = []
    original = Store.commit_bytes

    def recording(self: Store, rel: str, payload: bytes, **kwargs: Any) -> None:
        if not self.is_local:
            commits.append(self.url_of(rel))
        original(self, rel, payload, **kwargs)

    class KillDuringSecondDrain(Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:  # the tiers are set up
            tiers = trainer.strategy.checkpoint_io.tiers  # type: ignore[attr-defined]
            uploaded = [0]

            def progress(n: int) -> None:
                uploaded[0] += n
                drains = [d for d in tiers.drains if d.started is not None]
                if len(drains) >= 2 and server.alive:
                    server.kill()  # mid-upload of step 6's files

            tiers.progress = progress

    caplog.set_level(logging.INFO, logger="lightning_preempt")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Store, "commit_bytes", recording)
            io = _fit(
                url, options, local, max_steps=9, seed=0, width=512,
                tuning=Tuning(retries=2, backoff_s=0.05), callbacks=[KillDuringSecondDrain()],
            ).io  # fmt: skip
        assert not server.alive
        # Training went on to the end; every checkpoint is committed on the local tier.
        assert committed(str(local)) == [9, 6]
        assert io.tiers is not None
        ok = [d.step for d in io.tiers.drains if d.error is None and d.skipped is None]
        failed = [d for d in io.tiers.drains if d.error is not None]
        assert ok == [3] and failed and all("HINT:" in (d.error or "") for d in failed)
        assert all(d.error is not None or d.skipped == "superseded" for d in io.tiers.drains if d.step != 3)
        # Only step 3's manifest ever reached the bucket: the killed upload committed nothing.
        assert [c for c in commits if c.endswith(MANIFEST_NAME)] == [f"{url}/{_name(3)}/{MANIFEST_NAME}"]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("HINT:" in e and failed[0].name in e for e in errors), errors
        assert not any(options["secret"] == "y" and "'secret': 'y'" in e for e in errors)
    finally:
        server.stop()


def test_local_disk_failure_falls_back_to_the_remote_tier(tmp_path: Path, gs_remote: Remote) -> None:
    local = tmp_path / "full-disk"
    local.write_text("not a directory")  # every local write fails (like ENOSPC)
    io = _fit(gs_remote.url, gs_remote.storage_options, local, max_steps=6, seed=0).io
    assert committed(gs_remote.url, gs_remote.storage_options) == [6, 3]
    assert all(r.error is None for r in io.history)


def test_helpers() -> None:
    assert [writer_of(n) for n in ("__1_0.distcp", "state-rank00003.pt", ".metadata", "__0_2.distcp")] == [1, 3, 0, 0]
    assert redact("key AKIAXYZ secret s3cr3t at http://h", {"key": "AKIAXYZ", "secret": "s3cr3t"}) == (
        "key *** secret *** at http://h"
    )
