"""Choosing the newest valid checkpoint, and retention: only committed ones count."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ckpts import lightning_like_checkpoint

from lightning_preempt import ShardedAsyncCheckpointIO, UnsupportedFormatError, list_checkpoints, newest_valid
from lightning_preempt.catalog.retention import apply_retention
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name


def _save_steps(root: Path, steps: list[int], width: int = 32) -> None:
    io = ShardedAsyncCheckpointIO()
    for step in steps:
        io.save_checkpoint(lightning_like_checkpoint(step=step, width=width), str(root / checkpoint_name(step)))
    io.teardown()


def _shard(ckpt: Path) -> Path:
    return next(ckpt.glob("__0_*.distcp"))


def _flip_bytes(ckpt: Path) -> None:
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:-100])


def _remove_manifest(ckpt: Path) -> None:
    (ckpt / MANIFEST_NAME).unlink()


def _garbage_manifest(ckpt: Path) -> None:
    (ckpt / MANIFEST_NAME).write_bytes(b"\x00garbage{")


def _missing_state_file(ckpt: Path) -> None:
    (ckpt / "state-rank00000.pt").unlink()


def _newer_version(ckpt: Path) -> None:
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    body["version"] = 999
    (ckpt / MANIFEST_NAME).write_text(json.dumps(body))


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "flipped-bytes": _flip_bytes,
    "truncated": _truncate,
    "missing-manifest": _remove_manifest,
    "garbage-manifest": _garbage_manifest,
    "missing-file": _missing_state_file,
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(
    corrupt: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save_steps(tmp_path, [10, 20])
    CORRUPTIONS[corrupt](tmp_path / checkpoint_name(20))
    skipped: list[tuple[str, str]] = []
    chosen = newest_valid(str(tmp_path), on_skip=lambda info, why: skipped.append((info.name, why)))
    assert chosen is not None and chosen.step == 10
    assert [name for name, _ in skipped] == [checkpoint_name(20)]
    # The plugin, given the directory, loads the same fallback; the warning names it.
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):  # our logger propagates
        ckpt = ShardedAsyncCheckpointIO().load_checkpoint(str(tmp_path))
    assert ckpt["global_step"] == 10
    assert checkpoint_name(20) in caplog.text


def test_a_newer_format_version_stops_resume_instead_of_going_back(tmp_path: Path) -> None:
    _save_steps(tmp_path, [10, 20])
    _newer_version(tmp_path / checkpoint_name(20))
    with pytest.raises(UnsupportedFormatError, match="Upgrade lightning_preempt"):
        newest_valid(str(tmp_path))
    infos = list_checkpoints(str(tmp_path))
    assert infos[0].newer_format and not infos[0].committed


def test_flipped_tensor_bytes_are_caught_when_loading_directly(tmp_path: Path) -> None:
    _save_steps(tmp_path, [10])
    _flip_bytes(tmp_path / checkpoint_name(10))
    with pytest.raises(Exception, match="CRC32C"):
        ShardedAsyncCheckpointIO().load_checkpoint(str(tmp_path / checkpoint_name(10)))


def test_listing_is_newest_first_and_marks_partial_saves(tmp_path: Path) -> None:
    _save_steps(tmp_path, [5, 15])
    (tmp_path / checkpoint_name(25)).mkdir()  # a save killed before its commit
    (tmp_path / "unrelated").mkdir()
    infos = list_checkpoints(str(tmp_path))
    assert [(c.step, c.committed) for c in infos] == [(25, False), (15, True), (5, True)]
    assert infos[1].size_bytes and infos[1].world_size == 1


def test_retention_keeps_the_newest_committed_and_drops_old_leftovers(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2, 3, 4])
    (tmp_path / checkpoint_name(0)).mkdir()  # old leftover
    (tmp_path / checkpoint_name(9)).mkdir()  # newer than every commit: maybe in flight, kept
    removed = apply_retention(str(tmp_path), keep_last_n=2)
    assert sorted(Path(p).name for p in removed) == [checkpoint_name(s) for s in (0, 1, 2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(s) for s in (3, 4, 9)]


def test_partial_directories_never_push_out_the_last_good_checkpoint(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    for step in (2, 3, 4):
        (tmp_path / checkpoint_name(step)).mkdir()
    apply_retention(str(tmp_path), keep_last_n=1)
    chosen = newest_valid(str(tmp_path))
    assert chosen is not None and chosen.step == 1


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch
    from lightning_preempt import ShardedAsyncCheckpointIO
    root = sys.argv[1]
    io = ShardedAsyncCheckpointIO()
    state = {"state_dict": {f"w{i}": torch.randn(2_000_000) for i in range(24)}, "global_step": 2, "epoch": 0}
    io.save_checkpoint(state, root + "/step-0000000002")
    print("STAGED", flush=True)
    io.wait()
    print("COMMITTED", flush=True)
    """
)


def test_a_writer_sigkilled_mid_flush_leaves_no_committed_checkpoint(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "STAGED"
    # Kill as soon as the flush has visibly started (some shard bytes on disk).
    target = tmp_path / checkpoint_name(2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(p.stat().st_size > 0 for p in target.glob("*.distcp")):
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (target / MANIFEST_NAME).exists(), "the kill came too late to test a partial flush"
    infos = {c.step: c.committed for c in list_checkpoints(str(tmp_path))}
    assert infos == {2: False, 1: True}
    chosen = newest_valid(str(tmp_path))
    assert chosen is not None and chosen.step == 1
