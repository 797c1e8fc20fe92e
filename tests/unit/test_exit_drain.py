"""A save pending when a worker process ends is committed, whichever way it ends (issue 21,
finding a). ``multiprocessing`` workers started with ``fork`` (Lightning's ``ddp_fork`` and
``ddp_notebook``) leave through ``os._exit``, where ``atexit`` never runs."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
from ckpts import lightning_like_checkpoint

from lightning_preempt import ShardedAsyncCheckpointIO, list_checkpoints


def _worker(path: str, how: str) -> None:
    io = ShardedAsyncCheckpointIO()
    io.submit(lambda: time.sleep(0.5))  # the save is still queued when the worker's function returns
    io.save_checkpoint(lightning_like_checkpoint(step=9), path)
    if how == "system_exit":
        raise SystemExit(3)


@pytest.mark.parametrize("how", ["return", "system_exit"])
def test_a_forked_worker_commits_its_pending_save(tmp_path: Path, how: str) -> None:
    path = str(tmp_path / "final")
    proc = multiprocessing.get_context("fork").Process(target=_worker, args=(path, how))
    proc.start()
    proc.join(60)
    assert proc.exitcode == (3 if how == "system_exit" else 0)
    [info] = list_checkpoints(str(tmp_path))
    assert info.path.endswith("final") and info.step == 9
    assert ShardedAsyncCheckpointIO().load_checkpoint(path)["global_step"] == 9
