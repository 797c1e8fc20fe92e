"""The plugin on its own (outside a Trainer): staging, ordering, errors, loading."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from ckpts import assert_same, lightning_like_checkpoint
from faulty_fs import FaultyFileSystem

from lightning_preempt import CheckpointWriteError, NotACheckpointError, ShardedAsyncCheckpointIO, list_checkpoints
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.storage.store import Store


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path, memory_url: str) -> str:
    return str(tmp_path / "ck") if request.param == "local" else memory_url


def test_round_trip_is_exact(root: str) -> None:
    io = ShardedAsyncCheckpointIO()
    ckpt = lightning_like_checkpoint()
    io.save_checkpoint(ckpt, f"{root}/one")
    manifest = io.wait()
    assert manifest is not None and manifest.step == 5
    assert_same(ckpt, io.load_checkpoint(f"{root}/one"))
    io.teardown()


def test_mutation_after_save_returns_does_not_leak(root: str) -> None:
    io = ShardedAsyncCheckpointIO()
    ckpt = lightning_like_checkpoint()
    expected = {k: v.clone() for k, v in ckpt["state_dict"].items()}
    expected_avg = ckpt["optimizer_states"][0]["state"][0]["exp_avg"].clone()
    io.save_checkpoint(ckpt, f"{root}/one")
    # Mutate in place immediately, as the next optimizer step would.
    for t in ckpt["state_dict"].values():
        t.add_(1000.0)
    ckpt["optimizer_states"][0]["state"][0]["exp_avg"].mul_(-7)
    ckpt["loops"]["fit_loop"]["batches"].append(99)
    io.wait()
    loaded = io.load_checkpoint(f"{root}/one")
    for k, v in expected.items():
        assert torch.equal(loaded["state_dict"][k], v)
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["exp_avg"], expected_avg)
    assert loaded["loops"]["fit_loop"]["batches"] == [1, 2]
    io.teardown()


def test_staging_memory_is_allocated_once_and_reused(root: str) -> None:
    io = ShardedAsyncCheckpointIO()
    ckpt = lightning_like_checkpoint(width=64)
    io.save_checkpoint(ckpt, f"{root}/a")
    first = io.staging_allocated_bytes
    assert first > 0
    for name in ("b", "c", "d"):
        io.save_checkpoint(ckpt, f"{root}/{name}")
    io.wait()
    assert io.staging_allocated_bytes == first
    io.teardown()


def test_a_new_save_waits_until_the_previous_is_written_and_commits_in_order(root: str) -> None:
    io = ShardedAsyncCheckpointIO()
    ckpt = lightning_like_checkpoint()
    io.save_checkpoint(ckpt, f"{root}/a")
    io.save_checkpoint(ckpt, f"{root}/b")
    # When the second returned, the first's tensors were written (the staging buffers it
    # reuses were free); its commit may still run (one rank), the second's comes after it.
    assert Store(f"{root}/a").stat(".metadata") is not None
    io.wait()
    assert {c.name for c in list_checkpoints(root) if c.committed} == {"a", "b"}
    a, b = io.saver.history[-2:]
    assert a.committed_s is not None and b.committed_s is not None
    assert a.started + a.committed_s <= b.started + b.committed_s
    io.teardown()


def test_the_next_save_stages_while_the_previous_one_commits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One rank: the next save reuses the staging buffers once the previous one's tensors are
    # written, while its manifest is still being committed; each checkpoint keeps its own values.
    gate, committing = threading.Event(), threading.Event()
    real = Store.commit_bytes

    def held(self: Store, rel: str, data: bytes, **kwargs: bool) -> None:
        if rel == MANIFEST_NAME and not gate.is_set():
            committing.set()
            assert gate.wait(60)
        real(self, rel, data, **kwargs)

    monkeypatch.setattr(Store, "commit_bytes", held)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(step=1), a)
    assert committing.wait(60)
    io.save_checkpoint(lightning_like_checkpoint(step=2), b)  # returns: a's commit is held
    assert Store(a).stat(MANIFEST_NAME) is None and Store(b).stat(MANIFEST_NAME) is None
    gate.set()
    io.wait()
    assert_same(lightning_like_checkpoint(step=1), io.load_checkpoint(a))
    assert_same(lightning_like_checkpoint(step=2), io.load_checkpoint(b))
    io.teardown()


def test_a_commit_failing_after_the_next_save_staged_is_raised_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = Store.commit_bytes

    def failing(self: Store, rel: str, data: bytes, **kwargs: bool) -> None:
        if rel == MANIFEST_NAME and str(tmp_path / "a") in self.url:
            assert gate.wait(60)
            raise OSError(28, "No space left on device (injected)")
        real(self, rel, data, **kwargs)

    monkeypatch.setattr(Store, "commit_bytes", failing)
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(step=1), str(tmp_path / "a"))
    io.save_checkpoint(lightning_like_checkpoint(step=2), str(tmp_path / "b"))  # a still committing
    gate.set()
    with pytest.raises(CheckpointWriteError, match="No space left"):
        io.wait()
    io.wait()  # raised once
    assert Store(str(tmp_path / "a")).stat(MANIFEST_NAME) is None
    assert io.load_checkpoint(str(tmp_path / "b"))["global_step"] == 2
    io.teardown()


def test_saving_over_a_committed_checkpoint_replaces_it(root: str) -> None:
    # Lightning saves over last.ckpt by design; the old one stands until the new one commits
    # (crash at every moment: tests/test_dropin.py).
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(step=1), f"{root}/a")
    io.wait()
    io.save_checkpoint(lightning_like_checkpoint(step=2), f"{root}/a")
    io.wait()
    assert_same(lightning_like_checkpoint(step=2), io.load_checkpoint(f"{root}/a"))
    assert [(c.name, c.step, c.committed) for c in list_checkpoints(root)] == [("a", 2, True)]
    io.teardown()


def test_an_uncommitted_leftover_is_replaced_not_mixed(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    (root / "a").mkdir(parents=True)
    (root / "a" / "__0_0.distcp").write_bytes(b"stale bytes from a killed save")
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(step=3), str(root / "a"))
    io.wait()
    # Our stale shard was cleared before writing (a directory holding files we never write
    # is refused instead: tests/unit/test_save_ownership.py).
    assert (root / "a" / "__0_0.distcp").read_bytes() != b"stale bytes from a killed save"
    assert io.load_checkpoint(str(root / "a"))["global_step"] == 3
    io.teardown()


def test_a_delete_never_overtakes_a_pending_write(root: str) -> None:
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(width=256), f"{root}/a")
    io.remove_checkpoint(f"{root}/a")
    io.wait()
    assert [c.name for c in list_checkpoints(root)] == []
    io.teardown()


def test_writer_failure_commits_nothing_and_is_raised_once() -> None:
    FaultyFileSystem.reset(fail_after_bytes=2000)
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(width=64), "faulty://run/a")
    with pytest.raises(CheckpointWriteError) as info:
        io.wait()
    assert "faulty" in str(info.value) and "HINT:" in str(info.value)
    assert "No space left" in str(info.value)
    io.wait()  # raised once: the error is not kept forever
    assert not FaultyFileSystem().exists(f"run/a/{MANIFEST_NAME}")
    assert [c.committed for c in list_checkpoints("faulty://run")] in ([], [False])
    # The plugin keeps working once storage recovers.
    FaultyFileSystem.fail_after_bytes = None
    io.save_checkpoint(lightning_like_checkpoint(step=9), "faulty://run/b")
    assert io.wait() is not None
    assert io.load_checkpoint("faulty://run/b")["global_step"] == 9
    io.teardown()


def test_a_failed_save_is_reported_by_the_next_save() -> None:
    FaultyFileSystem.reset(fail_after_bytes=100)
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(), "faulty://run2/a")
    with pytest.raises(CheckpointWriteError, match="previous checkpoint save failed"):
        io.save_checkpoint(lightning_like_checkpoint(), "faulty://run2/b")
    assert list_checkpoints("faulty://run2") == [] or not any(c.committed for c in list_checkpoints("faulty://run2"))
    io.teardown()


def test_load_errors_name_the_path_and_say_what_to_do(tmp_path: Path) -> None:
    io = ShardedAsyncCheckpointIO()
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(NotACheckpointError) as info:
            io.load_checkpoint(str(bad))
        assert str(bad) in str(info.value) and "HINT:" in str(info.value)


def test_a_directory_of_checkpoints_loads_the_newest(root: str) -> None:
    io = ShardedAsyncCheckpointIO()
    for step in (1, 3, 2):
        io.save_checkpoint(lightning_like_checkpoint(step=step), f"{root}/step-{step:010d}")
    io.wait()
    assert io.load_checkpoint(root)["global_step"] == 3
    io.teardown()


def test_plain_lightning_ckpt_files_still_load(tmp_path: Path) -> None:
    ckpt = lightning_like_checkpoint()
    torch.save(ckpt, tmp_path / "plain.ckpt")
    assert_same(ckpt, ShardedAsyncCheckpointIO().load_checkpoint(str(tmp_path / "plain.ckpt")))


def test_saving_from_another_thread_than_the_writer_is_safe(root: str) -> None:
    io = ShardedAsyncCheckpointIO()
    errors: list[BaseException] = []

    def save() -> None:
        try:
            io.save_checkpoint(lightning_like_checkpoint(step=4), f"{root}/t")
            io.wait()
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    t = threading.Thread(target=save)
    t.start()
    t.join()
    assert not errors
    assert io.load_checkpoint(f"{root}/t")["global_step"] == 4
    assert os.getpid() > 0
    io.teardown()
