"""Issue 20, finding 1: a save never deletes or writes into a directory it did not write.

``Trainer.save_checkpoint(d)`` before ``fit``, the plugin's ``save_checkpoint`` after
``teardown`` (both write a plain file atomically) or a sharded save into ``d``, where ``d``
is a user's directory, is refused with a HINT and leaves every file of it as it was. The
one ownership check (catalog/ownership.check_owned) stands in front of every recursive
delete: storage refuses to delete a tree without its verdict.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ckpts import lightning_like_checkpoint
from models import TinyModel
from trainers import make_trainer

from lightning_preempt.errors import CheckpointError, CheckpointExistsError
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.storage import local
from lightning_preempt.storage.store import Store, kind_at
from lightning_preempt.write.replace import write_file_atomic

USER_FILES = {"src/train.py": b"print('my training script')\n", "results.csv": b"step,loss\n1,0.5\n"}


def _user_dir(path: Path, files: dict[str, bytes] = USER_FILES) -> Path:
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _assert_refused_with_hint(info: pytest.ExceptionInfo[CheckpointError], path: Path) -> None:
    text = str(info.value)
    assert str(path) in text and "did not write" in text and "\nHINT:" in text, text


def test_trainer_save_checkpoint_before_fit_keeps_a_users_directory(tmp_path: Path) -> None:
    users = _user_dir(tmp_path / "project")
    trainer = make_trainer(3, [], root=tmp_path / "root")
    trainer.strategy.connect(TinyModel())
    with pytest.raises(CheckpointExistsError) as info:
        trainer.save_checkpoint(str(users))
    _assert_refused_with_hint(info, users)
    assert _files(users) == USER_FILES  # nothing deleted, nothing added
    assert os.listdir(tmp_path) == ["project"]  # no aside/new sibling left


def test_plugin_save_after_teardown_keeps_a_users_directory(tmp_path: Path) -> None:
    users = _user_dir(tmp_path / "project")
    io = ShardedAsyncCheckpointIO()
    io.teardown()
    with pytest.raises(CheckpointExistsError) as info:
        io.save_checkpoint(lightning_like_checkpoint(step=3), str(users))
    _assert_refused_with_hint(info, users)
    assert _files(users) == USER_FILES
    # An empty directory is nobody's data: it is replaced by the plain checkpoint file.
    (tmp_path / "empty").mkdir()
    io.save_checkpoint(lightning_like_checkpoint(step=4), str(tmp_path / "empty"))
    assert (tmp_path / "empty").is_file() and io.load_checkpoint(str(tmp_path / "empty"))["global_step"] == 4


def test_a_sharded_save_refuses_a_users_manifest_and_files(tmp_path: Path) -> None:
    """During fit (the async sharded path): a directory holding the user's own
    ``manifest.json`` or other files is neither written into nor overwritten."""
    mine = {"manifest.json": b'{"name": "my web app", "version": "1.0"}\n', "index.html": b"<html/>"}
    for name, files in (
        ("web", mine),
        ("project", USER_FILES),
        ("only-manifest", {"manifest.json": mine["manifest.json"]}),
    ):
        users = _user_dir(tmp_path / name, files)
        io = ShardedAsyncCheckpointIO()
        io.save_checkpoint(lightning_like_checkpoint(step=5), str(users))
        with pytest.raises(CheckpointError) as info:
            io.wait()
        _assert_refused_with_hint(info, users)
        assert _files(users) == files, name
        io.teardown()


def test_a_save_over_our_own_checkpoint_directory_still_replaces_it(tmp_path: Path) -> None:
    io = ShardedAsyncCheckpointIO()
    io.save_checkpoint(lightning_like_checkpoint(step=1), str(tmp_path / "last.ckpt"))
    io.save_checkpoint(lightning_like_checkpoint(step=2), str(tmp_path / "last.ckpt"))
    io.teardown()
    io.save_checkpoint(lightning_like_checkpoint(step=3), str(tmp_path / "last.ckpt"))  # outside fit: a file
    assert (tmp_path / "last.ckpt").is_file() and io.load_checkpoint(str(tmp_path / "last.ckpt"))["global_step"] == 3
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_memory_store_plain_save_keeps_a_users_directory(memory_url: str) -> None:
    store = Store(f"{memory_url}/project")
    store.commit_bytes("src/train.py", b"code", exclusive=False)
    with pytest.raises(CheckpointExistsError, match=r"src \(dir\)"):
        write_file_atomic(store, b"a plain checkpoint")
    assert store.read_bytes("src/train.py") == b"code" and kind_at(store) == "dir"


def test_every_recursive_delete_demands_the_ownership_verdict(tmp_path: Path) -> None:
    from lightning_preempt.catalog.ownership import check_owned
    from lightning_preempt.storage.local import UncheckedRemoveError

    users = _user_dir(tmp_path / "project")
    with pytest.raises(UncheckedRemoveError):
        local.remove_local(str(users))
    other = _user_dir(tmp_path / "other", {"x": b"1"})
    with pytest.raises(UncheckedRemoveError):  # a verdict for another path does not do
        Store(str(users)).rm_tree(owned=check_owned(Store(str(tmp_path / "empty-or-absent"))))
    (tmp_path / "new").mkdir()
    with pytest.raises(UncheckedRemoveError):
        local.replace_entry(str(users), str(tmp_path / "new"), str(tmp_path / "aside"))
    with pytest.raises(CheckpointExistsError):
        check_owned(Store(str(users)))
    assert _files(users) == USER_FILES and _files(other) == {"x": b"1"}
