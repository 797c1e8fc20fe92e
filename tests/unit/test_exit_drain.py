"""A save pending when a worker process ends is committed, whichever way it ends (issue 21,
finding a). ``multiprocessing`` workers started with ``fork`` (Lightning's ``ddp_fork`` and
``ddp_notebook``) leave through ``os._exit``, where ``atexit`` never runs."""

from __future__ import annotations

import multiprocessing
import multiprocessing.util as mp_util
import os
import threading
from pathlib import Path

import pytest
from ckpts import lightning_like_checkpoint

from lightning_preempt import ShardedAsyncCheckpointIO, list_checkpoints
from lightning_preempt.write.jobs import EXIT_PRIORITY


def _worker(path: str, how: str) -> None:
    io = ShardedAsyncCheckpointIO()
    # The job queue is held shut until the process exits (the gate opens in a finalizer that
    # runs just before the package's drain): the save is certainly pending when this returns.
    gate = threading.Event()
    io.submit(gate.wait)
    mp_util.Finalize(None, gate.set, exitpriority=EXIT_PRIORITY + 1)
    io.save_checkpoint(lightning_like_checkpoint(step=9), path)
    assert not os.path.exists(os.path.join(path, "manifest.json"))  # not committed yet
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
