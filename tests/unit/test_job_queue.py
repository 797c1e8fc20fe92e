"""The background job queue never lets a delete overtake a write (write/jobs.py), and the
plugin built on it keeps that order on a slow storage (lightning/checkpoint_io.py)."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from ckpts import lightning_like_checkpoint
from throttled_fs import ThrottledFileSystem, set_rate

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.write.jobs import JobQueue

WAIT_S = 30  # a bound for the waits below, never reached when the code is right


def test_jobs_run_in_submission_order_behind_a_slow_first_job() -> None:
    queue = JobQueue(name="lightning_preempt-test-queue")
    order: list[str] = []
    started, release = threading.Event(), threading.Event()

    def slow_write() -> str:
        started.set()
        assert release.wait(WAIT_S)
        order.append("write")
        return "written"

    write = queue.submit(slow_write)
    assert started.wait(WAIT_S)
    delete = queue.submit(lambda: order.append("delete"))
    after = queue.submit(lambda: order.append("after"))
    # The write is still running: nothing queued behind it may have run.
    assert order == [] and not delete.done() and not after.done()
    release.set()
    queue.drain()
    assert order == ["write", "delete", "after"]
    assert write.result() == "written" and delete.done() and after.done()
    queue.close()
    assert not queue.running


def test_a_failing_job_reports_through_its_future_and_the_queue_goes_on() -> None:
    queue = JobQueue(name="lightning_preempt-test-queue")
    order: list[str] = []

    def broken() -> None:
        order.append("broken")
        raise OSError("disk gone")

    failed = queue.submit(broken)
    later = queue.submit(lambda: order.append("later") or "ok")
    queue.drain()  # errors stay in their Futures
    assert isinstance(failed.exception(timeout=WAIT_S), OSError) and str(failed.exception()) == "disk gone"
    assert later.result(timeout=WAIT_S) == "ok" and order == ["broken", "later"]
    queue.close()


def test_close_finishes_queued_jobs_and_a_later_submit_starts_again() -> None:
    queue = JobQueue(name="lightning_preempt-test-queue")
    release = threading.Event()
    done: list[int] = []
    queue.submit(lambda: release.wait(WAIT_S))
    futures = [queue.submit(lambda i=i: done.append(i)) for i in range(3)]
    assert queue.running
    release.set()
    queue.close()
    assert done == [0, 1, 2] and all(f.done() for f in futures) and not queue.running
    assert queue.submit(lambda: "again").result(timeout=WAIT_S) == "again" and queue.running
    queue.close()


def test_a_thread_reaper_stops_the_writer_after_its_queued_jobs() -> None:
    # Lightning's test suite calls stop() on every daemon thread a test leaves behind
    # (tests_fabric/conftest.py); a thread without it fails the test.
    queue = JobQueue(name="lightning_preempt-test-reaped")
    release, done = threading.Event(), []
    queue.submit(lambda: release.wait(WAIT_S))
    pending = queue.submit(lambda: done.append("written"))
    (thread,) = [t for t in threading.enumerate() if t.name == "lightning_preempt-test-reaped"]
    assert thread.daemon
    release.set()
    thread.stop()  # type: ignore[attr-defined]
    assert done == ["written"] and pending.done() and not thread.is_alive() and not queue.running
    assert queue.submit(lambda: "again").result(timeout=WAIT_S) == "again"
    queue.close()


def test_a_pickled_copy_is_an_idle_queue_of_its_own() -> None:
    queue = JobQueue(name="lightning_preempt-test-queue")
    release = threading.Event()
    queue.submit(lambda: release.wait(WAIT_S))
    copy = pickle.loads(pickle.dumps(queue))
    assert queue.running and not copy.running
    assert copy.submit(lambda: "mine").result(timeout=WAIT_S) == "mine"  # runs though the original is busy
    release.set()
    queue.close()
    copy.close()


# ---- the plugin: save then remove the same path, on a slow storage -----------------------------
class RecordingSlowFileSystem(ThrottledFileSystem):
    """``slowlog://``: ``slow://`` (local disk behind a bandwidth limit) that records every
    write, create-only commit and removal, in the order the storage saw them."""

    protocol = "slowlog"
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def _record(self, op: str, path: Any) -> None:
        with self.lock:
            self.events.append((op, self._strip_protocol(str(path))))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" not in mode:
            self._record("write", path)
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        super().pipe_file(path, value, mode=mode, **kwargs)
        self._record("commit" if mode == "create" else "write", path)

    def rm_file(self, path: str) -> None:
        self._record("rm", path)
        super().rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._record("rm", path)
        super().rm(path, recursive=recursive, maxdepth=maxdepth)


fsspec.register_implementation("slowlog", RecordingSlowFileSystem, clobber=True)


@pytest.fixture
def slow_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    ctl = tmp_path / "link"
    monkeypatch.setenv("LP_SLOW_DIR", str(ctl))
    RecordingSlowFileSystem.events.clear()
    yield ctl
    set_rate(ctl, 0)


def test_a_remove_right_after_a_save_waits_for_its_commit_and_leaves_nothing(
    tmp_path: Path, slow_storage: Path
) -> None:
    events = RecordingSlowFileSystem.events
    root = tmp_path / "bucket"
    url = f"slowlog://{root}/last.ckpt"
    checkpoint = lightning_like_checkpoint(step=3, width=256)  # ~40 kB of tensors
    set_rate(slow_storage, 80_000)  # ~0.5 s for the write: the remove is asked for long before the commit
    io = ShardedAsyncCheckpointIO()
    try:
        io.save_checkpoint(checkpoint, url)
        io.remove_checkpoint(url)
        asked = len(events)
        assert not any(op == "commit" for op, _ in events), "committed before the remove was even asked for"
        io.wait()
    finally:
        io.teardown()
    ops = [(op, Path(path).name) for op, path in events]
    commit = ops.index(("commit", MANIFEST_NAME))
    removals = [i for i, (op, _) in enumerate(ops) if op == "rm"]
    assert commit >= asked and removals, ops
    assert min(removals) > commit, ops  # the delete waited for the write it was queued behind
    assert all(i < commit for i, (op, _) in enumerate(ops) if op == "write"), ops  # manifest last
    leftovers = sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []
    assert leftovers == []  # and it removed everything the save wrote
