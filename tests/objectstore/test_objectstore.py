"""Object stores: gs:// (GCS emulator) and s3:// (moto server), both on 127.0.0.1.

The plugin, discovery, verification and draining against real HTTP servers, failures
mid-upload, and real ``trainer.fit`` runs that save to and resume from a bucket.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
import pytest
import servers
import torch
from ckpts import assert_same, committed, lightning_like_checkpoint
from trainers import fit

from lightning_preempt import (
    CheckpointExistsError,
    CheckpointWriteError,
    CorruptCheckpointError,
    NotACheckpointError,
    ShardedAsyncCheckpointIO,
    list_checkpoints,
)
from lightning_preempt.catalog.newest import newest_valid
from lightning_preempt.catalog.retention import apply_retention
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.read.verify import read_manifest, verify_checkpoint
from lightning_preempt.storage.object_store import gcs_crc32c
from lightning_preempt.storage.store import Store, files_below, kind_at
from lightning_preempt.tiers.drain import drain_checkpoint

if TYPE_CHECKING:
    from objectstore_plugin import Remote

pytest_plugins = ["objectstore_plugin"]
pytestmark = [pytest.mark.objectstore, pytest.mark.timeout(120)]

MiB = 1 << 20


def _save(io: ShardedAsyncCheckpointIO, ckpt: dict[str, Any], url: str) -> None:
    io.save_checkpoint(ckpt, url)
    io.wait()


def _big_checkpoint(nbytes: int, step: int = 1) -> dict[str, Any]:
    ckpt = lightning_like_checkpoint(step)
    torch.manual_seed(step)
    ckpt["state_dict"]["big"] = torch.randn(nbytes // 4)
    return ckpt


def _local_checkpoint(tmp_path: Path, ckpt: dict[str, Any], name: str = "step-1") -> Store:
    io = ShardedAsyncCheckpointIO()
    try:
        _save(io, ckpt, str(tmp_path / name))
    finally:
        io.teardown()
    return Store(str(tmp_path / name))


def _raw_fs(remote: Remote) -> fsspec.AbstractFileSystem:
    fs, _ = fsspec.core.url_to_fs(remote.url, **remote.storage_options)
    fs.invalidate_cache()
    return fs


# ---- the plugin on its own ---------------------------------------------------------------
def test_plugin_round_trip_list_retention_remove(remote: Remote) -> None:
    io = ShardedAsyncCheckpointIO(storage_options=remote.storage_options)
    try:
        saved = {}
        for step in (1, 2, 3):
            saved[step] = lightning_like_checkpoint(step)
            _save(io, copy.deepcopy(saved[step]), remote.join(f"step-{step:010d}"))
        infos = list_checkpoints(remote.url, remote.storage_options)
        assert [(c.step, c.committed) for c in infos] == [(3, True), (2, True), (1, True)]
        assert infos[0].path == remote.join("step-0000000003")

        for step in (1, 3):
            assert_same(io.load_checkpoint(remote.join(f"step-{step:010d}")), saved[step])
        assert_same(io.load_checkpoint(remote.url), saved[3])  # a directory of checkpoints: the newest

        # Saving over a committed checkpoint replaces it (a generation dir, then one PUT of
        # the manifest: no renames); a create-only commit of different bytes is refused.
        _save(io, copy.deepcopy(saved[1]), remote.join("step-0000000003"))
        assert_same(io.load_checkpoint(remote.join("step-0000000003")), saved[1])
        _save(io, copy.deepcopy(saved[3]), remote.join("step-0000000003"))
        assert_same(io.load_checkpoint(remote.join("step-0000000003")), saved[3])
        listed = files_below(Store(remote.join("step-0000000003"), remote.storage_options))
        assert len({name.split("/")[0] for name in listed if name.startswith("v-")}) == 1, listed  # old one gone
        store = Store(remote.join("step-0000000003"), remote.storage_options)
        manifest_bytes = store.read_bytes(MANIFEST_NAME)
        store.commit_bytes(MANIFEST_NAME, manifest_bytes)  # same bytes: a retried PUT, fine
        with pytest.raises(CheckpointExistsError, match="HINT:"):
            store.commit_bytes(MANIFEST_NAME, manifest_bytes + b" ")
        assert store.read_bytes(MANIFEST_NAME) == manifest_bytes

        # An uncommitted leftover (no manifest) older than the newest committed one.
        Store(remote.join("step-0000000000"), remote.storage_options).commit_bytes("junk.distcp", b"x")
        removed = apply_retention(remote.url, 2, remote.storage_options)
        assert sorted(removed) == [remote.join("step-0000000000"), remote.join("step-0000000001")]
        assert [c.step for c in list_checkpoints(remote.url, remote.storage_options)] == [3, 2]

        io.remove_checkpoint(remote.join("step-0000000002"))
        io.wait()
        assert [c.step for c in list_checkpoints(remote.url, remote.storage_options)] == [3]
        assert not _raw_fs(remote).exists(remote.join("step-0000000002"))
    finally:
        io.teardown()


def test_verify_catches_a_corrupted_object(remote: Remote) -> None:
    io = ShardedAsyncCheckpointIO(storage_options=remote.storage_options)
    try:
        for step in (1, 2):
            _save(io, lightning_like_checkpoint(step), remote.join(f"step-{step:010d}"))
    finally:
        io.teardown()
    store = Store(remote.join("step-0000000002"), remote.storage_options)
    verify_checkpoint(store)
    shard = next(n for n in read_manifest(store).files if n.endswith(".distcp"))
    data = bytearray(store.read_bytes(shard))
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    _raw_fs(remote).pipe_file(store.path(shard), bytes(data))
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        verify_checkpoint(store)
    skipped: list[str] = []
    info = newest_valid(remote.url, remote.storage_options, on_skip=lambda i, why: skipped.append(i.name))
    assert info is not None and info.step == 1 and skipped == ["step-0000000002"]


# ---- draining ----------------------------------------------------------------------------
def test_drain_local_to_remote_and_back_to_a_new_node(tmp_path: Path, remote: Remote) -> None:
    ckpt = _big_checkpoint(12 * MiB)
    src = _local_checkpoint(tmp_path / "node-a", copy.deepcopy(ckpt))
    dst = Store(remote.join("step-0000000001"), remote.storage_options)
    manifest = read_manifest(src)

    copied: list[int] = []
    got = drain_checkpoint(src, dst, max_workers=3, progress=copied.append)
    assert got.files == manifest.files and sum(copied) == manifest.total_bytes
    assert dst.read_bytes(MANIFEST_NAME) == src.read_bytes(MANIFEST_NAME)
    verify_checkpoint(dst)
    if remote.scheme == "gs":  # GCS keeps a CRC32C per object: the same as our manifest's
        for name, entry in manifest.files.items():
            assert gcs_crc32c(dst.info(name)) == entry.crc32c, name

    # Idempotent: the same committed checkpoint is already there, nothing is copied.
    again: list[int] = []
    assert drain_checkpoint(src, dst, progress=again.append).files == manifest.files
    assert again == []

    # A different checkpoint is never drained over it.
    other = _local_checkpoint(tmp_path / "node-a", _big_checkpoint(MiB, step=2), name="step-2")
    with pytest.raises(CheckpointExistsError, match="HINT:"):
        drain_checkpoint(other, dst)

    # A new node restores from the bucket.
    restored = Store(str(tmp_path / "node-b" / "step-1"))
    drain_checkpoint(dst, restored)
    assert_same(load_full_checkpoint(restored), ckpt)
    assert committed(remote.url, remote.storage_options) == [1]


def test_drain_refuses_an_uncommitted_source(tmp_path: Path, gs_remote: Remote) -> None:
    src = _local_checkpoint(tmp_path, lightning_like_checkpoint(1))
    src.rm_file(MANIFEST_NAME)
    with pytest.raises(NotACheckpointError, match="HINT:"):
        drain_checkpoint(src, Store(gs_remote.join("step-1"), gs_remote.storage_options))
    assert not _raw_fs(gs_remote).exists(gs_remote.url)


class _FailingStore(Store):
    """Uploads through it break after ``fail_after`` bytes (a connection lost mid-upload)."""

    fail_after = 20 * MiB

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.written = 0

    def open_write(self, rel: str) -> Any:
        outer = self
        inner_cm = super().open_write(rel)

        class _Ctx:
            def __enter__(self) -> Any:
                f = inner_cm.__enter__()

                class _W:
                    def write(self, b: Any) -> int:
                        outer.written += len(b)
                        if outer.written > outer.fail_after:
                            raise ConnectionResetError("injected: connection reset by peer")
                        return int(f.write(b))

                return _W()

            def __exit__(self, *exc: Any) -> Any:
                return inner_cm.__exit__(*exc)

        return _Ctx()


def test_drain_failing_mid_upload_commits_nothing_and_cleans_up(tmp_path: Path, remote: Remote) -> None:
    src = _local_checkpoint(tmp_path, _big_checkpoint(64 * MiB))
    earlier = Store(remote.join("step-0000000000"), remote.storage_options)
    drain_checkpoint(_local_checkpoint(tmp_path, lightning_like_checkpoint(0), "step-0"), earlier)

    dst = _FailingStore(remote.join("step-0000000001"), remote.storage_options)
    with pytest.raises(CheckpointWriteError, match="HINT:") as caught:
        drain_checkpoint(src, dst, max_workers=2)
    assert "connection reset" in str(caught.value)
    fs = _raw_fs(remote)
    assert not fs.exists(dst.path(MANIFEST_NAME))
    assert fs.find(dst.path()) == []  # aborted uploads never became objects; the rest was removed
    assert [(c.step, c.committed) for c in list_checkpoints(remote.url, remote.storage_options)] == [(0, True)]


def test_s3_server_killed_mid_drain_raises_cleanly_without_a_commit(tmp_path: Path) -> None:
    src = _local_checkpoint(tmp_path, _big_checkpoint(64 * MiB))
    server = servers.start_s3()
    try:
        options = {
            **server.storage_options,
            # fail fast once the server is gone (the defaults retry for ~30 s)
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
        }
        commits: list[str] = []

        class _Recording(Store):
            def commit_bytes(self, rel: str, data: bytes, *, exclusive: bool = True, durable: bool = True) -> None:
                commits.append(rel)
                super().commit_bytes(rel, data, exclusive=exclusive, durable=durable)

        dst = _Recording(server.url("run/step-1"), options)
        copied = 0

        def kill_midway(n: int) -> None:
            nonlocal copied
            copied += n
            if copied >= 24 * MiB and server.alive:
                server.kill()

        started = time.monotonic()
        with pytest.raises(CheckpointWriteError, match="HINT:"):
            drain_checkpoint(src, dst, max_workers=2, progress=kill_midway)
        assert not server.alive and commits == []
        assert time.monotonic() - started < 60
    finally:
        server.stop()


# ---- real training -----------------------------------------------------------------------
def test_trainer_saves_to_and_resumes_from_a_bucket(remote: Remote) -> None:
    bucket = {"every": 3, "keep_last_n": 2, "storage_options": remote.storage_options}
    first = fit(remote.url, max_steps=6, seed=0, **bucket)
    assert first.probe.start_step == 0
    weights_at_6 = {k: v.clone() for k, v in first.model.state_dict().items()}
    infos = list_checkpoints(remote.url, remote.storage_options)
    assert [(c.step, c.committed) for c in infos] == [(6, True), (3, True)]

    second = fit(remote.url, max_steps=9, seed=123, **bucket)  # a "new process": different init
    assert second.callback.resumed_from == remote.join("step-0000000006")
    assert second.probe.start_step == 6
    for k, v in weights_at_6.items():
        assert torch.equal(second.probe.start_weights[k], v), k
    assert [c.step for c in list_checkpoints(remote.url, remote.storage_options)] == [9, 6]


def test_large_s3_writes_stream_as_multipart_uploads(s3_remote: Remote) -> None:
    from lightning_preempt.storage.store import UPLOAD_BLOCK_SIZE

    store = Store(s3_remote.url, s3_remote.storage_options)
    payload = bytes(UPLOAD_BLOCK_SIZE + MiB)
    with store.open_write("big.distcp") as f:
        f.write(payload)  # one call, like DCP writing a whole tensor: still split into parts
    info = store.info("big.distcp")
    assert info["size"] == len(payload)
    assert str(info["ETag"]).strip('"').endswith("-2")  # a multi-part upload of two parts


def test_the_path_exists_on_return_and_a_file_is_replaced_by_a_checkpoint(remote: Remote) -> None:
    """ModelCheckpoint asks ``fs.exists(path)`` right after a save (``-v1`` versioning): on
    an object store a marker object makes the prefix exist before the commit. A plain
    ``.ckpt`` object at the path (TorchCheckpointIO) gives way to our checkpoint after it commits."""
    io = ShardedAsyncCheckpointIO(storage_options=remote.storage_options)
    fs = _raw_fs(remote)
    url = remote.join("a.ckpt")
    io.save_checkpoint(_big_checkpoint(2 * MiB), url)
    fs.invalidate_cache()
    assert fs.exists(url)
    io.wait()
    plain = remote.join("plain.ckpt")
    with fs.open(plain, "wb") as f:
        torch.save(lightning_like_checkpoint(step=1), f)
    assert io.load_checkpoint(plain)["global_step"] == 1
    _save(io, lightning_like_checkpoint(step=2), plain)
    fs.invalidate_cache()
    assert not fs.isfile(plain)  # the plain object is gone, the checkpoint stands
    assert_same(io.load_checkpoint(plain), lightning_like_checkpoint(step=2))
    io.teardown()
    # Outside fit a save is one plain object again; the checkpoint objects under it go.
    io.save_checkpoint(lightning_like_checkpoint(step=3), plain)
    fs.invalidate_cache()
    _, plain_path = fsspec.core.url_to_fs(plain, **remote.storage_options)
    assert fs.isfile(plain) and [p for p in fs.find(plain_path) if p.startswith(plain_path + "/")] == []
    assert_same(io.load_checkpoint(plain), lightning_like_checkpoint(step=3))


def test_a_users_prefix_with_its_own_manifest_is_never_saved_over(remote: Remote) -> None:
    """Issue 20: a prefix holding the user's own ``manifest.json`` and files is neither
    written into (sharded save) nor deleted (a plain save outside fit deletes the objects
    under a checkpoint it replaces): both are refused with a HINT, every object kept."""
    fs = _raw_fs(remote)
    url = remote.join("site")
    users = {"manifest.json": b'{"name": "my site"}', "index.html": b"<html/>"}
    for name, data in users.items():
        fs.pipe_file(fsspec.core.url_to_fs(f"{url}/{name}", **remote.storage_options)[1], data)
    io = ShardedAsyncCheckpointIO(storage_options=remote.storage_options)
    io.save_checkpoint(lightning_like_checkpoint(step=2), url)
    with pytest.raises(CheckpointWriteError, match="not a lightning_preempt manifest") as info:
        io.wait()
    assert "\nHINT:" in str(info.value)
    io.teardown()
    with pytest.raises(CheckpointExistsError, match="not a lightning_preempt manifest"):
        io.save_checkpoint(lightning_like_checkpoint(step=3), url)  # outside fit: one plain object
    store = Store(url, remote.storage_options)
    assert {name: store.read_bytes(name) for name in users} == users and kind_at(store) != "file"
