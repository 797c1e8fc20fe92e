"""Tier 0 on a shared host (issue 55, items 1-4; docs/security.md "Tier 0 on a shared host"):
another local user can neither hand a victim its weights, nor read the victim's copies, nor
make the victim write through a symlink, nor hang or redirect the victim's tier 0.

The multi-user cases run as root here and act as another user (``nobody``) in a forked child
that drops to that uid; a private directory (mode 1777, like ``/dev/shm``) stands in for the
shared tmpfs. They are skipped only where the tests do not run as root.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import shutil
import stat
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_preempt.engine import memory_tier
from lightning_preempt.engine.loss_bound import SCHEDULE_FILE, read_schedule, write_schedule
from lightning_preempt.errors import CheckpointError
from lightning_preempt.format.manifest import FileEntry, Manifest, parse_manifest
from lightning_preempt.format.names import MANIFEST_NAME, SEAL_NAME, checkpoint_name
from lightning_preempt.read.seal import sealed
from lightning_preempt.resume.resolver import ResumeResolver
from lightning_preempt.tiers import tier0

OTHER_UID = 65534  # nobody: the other local user
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")


@pytest.fixture
def shm() -> Iterator[Path]:
    """A private stand-in for the shared ``/dev/shm``: mode 1777 (everyone may add entries,
    only their owner may rename or delete them), on the tmpfs where there is one."""
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="lp-test-i55-shm-", dir=parent))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_user(uid: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child running as ``uid`` (umask 0: the attacker makes everything
    world-writable); its result, or its exception raised here."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0)
            try:
                out: tuple[str, Any] = ("ok", fn())
            except BaseException as err:  # raised again in the parent
                out = ("err", (type(err).__name__, str(err), traceback.format_exc()))
            with os.fdopen(write_end, "wb") as f:
                pickle.dump(out, f)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child acting as another user failed"
    kind, value = pickle.loads(data)
    if kind == "err":
        name, message, tb = value
        raise AssertionError(f"as uid {uid}: {name}: {message}\n{tb}")
    return value


def _copy(root: Path, step: int, *, run_id: str) -> Path:
    """A committed one-rank copy of ``step`` (its sizes verify; the load would check CRC32C)."""
    d = root / checkpoint_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"w" * 10)
    manifest = Manifest(step=step, epoch=0, world_size=1, files={"__0_0.distcp": FileEntry(10, "00000000")},
                        run_id=run_id)  # fmt: skip
    (d / MANIFEST_NAME).write_bytes(manifest.to_json())
    return d


def _resolver(dirpath: Path, root: Path) -> ResumeResolver:
    resolver = ResumeResolver(str(dirpath), {}, memory_dirpath=str(root))
    resolver.memory_usable = True
    return resolver


def _choice(dirpath: Path, root: Path) -> str:
    return _resolver(dirpath, root).choose(None, tiers=None, verify="sizes").path


# ---- 1. another user's copy resumed -----------------------------------------------------------
@as_root
def test_a_copy_another_user_put_at_the_predictable_path_is_never_resumed(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker creates the victim's tier-0 directory first (its name is predictable) and
    commits a copy of its own there: the victim's tier 0 refuses the directory (off, loudly)
    and its restart resumes its own disk checkpoint, never the attacker's step 9."""
    dirpath = tmp_path / "ck"
    _copy(dirpath, 3, run_id="victim")
    root = shm / f"lightning_preempt-{os.geteuid()}" / "run-0123456789ab"

    def plant() -> None:
        root.mkdir(parents=True)
        _copy(root, 9, run_id="victim")  # the run id of the victim's manifests is no secret

    as_user(OTHER_UID, plant)
    tier = memory_tier.MemoryTier(str(root), 2)
    with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
        assert not tier.setup(None, leader=True)
    assert f"owned by uid {OTHER_UID}" in caplog.text and "HINT: " in caplog.text and "is off" in caplog.text
    assert _choice(dirpath, root) == str(dirpath / checkpoint_name(3))


def test_a_copy_of_another_run_in_this_users_directory_is_not_resumed(tmp_path: Path) -> None:
    """Same uid, another job (one ``memory_dirpath`` shared by two dirpaths, or a copy put
    there by hand): only the runs this dirpath recorded in the directory are resumed from."""
    dirpath, root = tmp_path / "ck", tmp_path / "t0"
    _copy(dirpath, 3, run_id="mine")
    _copy(root, 9, run_id="someone-else")
    tier = memory_tier.MemoryTier(str(root), 2)
    assert tier.setup(None, leader=True)
    tier.claim(str(dirpath), "mine")
    assert _choice(dirpath, root) == str(dirpath / checkpoint_name(3))
    _copy(root, 11, run_id="mine")  # this job's own copy: resumed (tier 0 works)
    assert _choice(dirpath, root) == str(root / checkpoint_name(11))
    tier.claim(str(tmp_path / "other-ck"), "someone-else")  # the other job records its run
    assert _choice(tmp_path / "other-ck", root) == str(root / checkpoint_name(9))
    assert _choice(dirpath, root) == str(root / checkpoint_name(11))  # each job its own


# ---- 2. copies readable by everyone -----------------------------------------------------------
@as_root
def test_another_user_cannot_read_a_victims_tier0_copy(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier0, "DEFAULT_TIER0_PARENT", str(shm))
    root = Path(tier0.default_memory_root("gs://bucket/run-7"))
    assert root.parent.parent == shm
    tier = memory_tier.MemoryTier(str(root), 2)
    assert tier.setup(None, leader=True)
    copy = _copy(root, 4, run_id="r")  # written with the process's umask, as the save pipeline does
    write_schedule(str(root), 12, 3)
    assert stat.S_IMODE(os.stat(root.parent).st_mode) == 0o700 and stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / SCHEDULE_FILE).st_mode) == 0o600

    def peek() -> list[str]:
        refused = []
        for path in (copy / "__0_0.distcp", copy / MANIFEST_NAME, root / SCHEDULE_FILE):
            try:
                path.read_bytes()
            except PermissionError:
                refused.append(path.name)
        return refused

    assert as_user(OTHER_UID, peek) == ["__0_0.distcp", MANIFEST_NAME, SCHEDULE_FILE]


@as_root
def test_each_user_of_a_host_gets_a_tier0_of_their_own(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first user of tier 0 on a host no longer owns the base: a second user's tier 0 is on."""
    monkeypatch.setattr(tier0, "DEFAULT_TIER0_PARENT", str(shm))
    first = tier0.default_memory_root("/data/run")
    assert memory_tier.MemoryTier(first, 2).setup(None, leader=True)

    def second_user() -> tuple[bool, str, object]:
        root = tier0.default_memory_root("/data/run")
        on = memory_tier.MemoryTier(root, 2).setup(None, leader=True)
        write_schedule(root, 5, 1)
        return on, root, read_schedule(root)

    on, theirs, schedule = as_user(OTHER_UID, second_user)
    assert on and theirs != first and schedule == {"every": 5, "copy_steps": 1}
    assert read_schedule(theirs) is None  # another user's file is not taken, even by root
    assert os.stat(theirs).st_uid == OTHER_UID and os.stat(first).st_uid == os.geteuid()


# ---- 3. a planted symlink makes the victim overwrite a file -------------------------------------
def test_a_symlink_at_the_schedules_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    root, private = tmp_path / "t0", tmp_path / "victim-0700"
    root.mkdir()
    private.mkdir(mode=0o700)
    precious = private / "model.ckpt"
    precious.write_bytes(b"the victim's bytes")
    planted = root / f"{SCHEDULE_FILE}.{os.getpid()}.tmp"
    planted.symlink_to(precious)
    write_schedule(str(root), 12, 3)
    assert precious.read_bytes() == b"the victim's bytes"
    assert planted.is_symlink() and os.readlink(planted) == str(precious)  # left as found
    assert read_schedule(str(root)) == {"every": 12, "copy_steps": 3}  # written all the same
    assert stat.S_IMODE(os.lstat(root / SCHEDULE_FILE).st_mode) == 0o600


def test_a_symlink_at_the_schedule_itself_is_replaced_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "t0"
    root.mkdir()
    precious = tmp_path / "precious"
    planted = json.dumps({"every": 1, "copy_steps": 1000}).encode()  # a bound that never holds
    precious.write_bytes(planted)
    (root / SCHEDULE_FILE).symlink_to(precious)
    assert read_schedule(str(root)) is None  # a symlink is never read through
    write_schedule(str(root), 2, 1)
    assert precious.read_bytes() == planted and not (root / SCHEDULE_FILE).is_symlink()


# ---- 4. a FIFO hangs the set-up; a symlinked run directory redirects writes ----------------------
def _finishes(fn: Callable[[], Any], fifo: Path) -> Any:
    """``fn()`` on a thread, bounded: a call blocked in ``open`` on ``fifo`` fails the test (and
    is released by a writer opening the FIFO, so the thread ends)."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    worker.start()
    worker.join(timeout=30)
    hung = worker.is_alive()
    if hung:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError as err:
            assert err.errno == errno.ENXIO
        worker.join(timeout=30)
    assert not hung, f"blocked opening the FIFO {fifo}"
    return result[0]


def test_a_fifo_at_the_schedule_file_does_not_hang_the_setup(tmp_path: Path) -> None:
    root = tmp_path / "t0"
    root.mkdir()
    os.mkfifo(root / SCHEDULE_FILE)
    tier = memory_tier.MemoryTier(str(root), "auto")
    assert _finishes(lambda: tier.setup(None, leader=True), root / SCHEDULE_FILE)  # on, nothing carried
    assert tier.loss.bound is None


def test_a_fifo_at_the_seal_does_not_hang_the_load(tmp_path: Path) -> None:
    copy = _copy(tmp_path / "t0", 4, run_id="r")
    os.mkfifo(copy / SEAL_NAME)
    manifest = parse_manifest((copy / MANIFEST_NAME).read_bytes(), path=str(copy))
    assert _finishes(lambda: sealed(str(copy), manifest), copy / SEAL_NAME) is False


@as_root
@pytest.mark.parametrize("given", [True, False], ids=["memory_dirpath-given", "default-root"])
def test_a_run_directory_replaced_by_a_symlink_is_refused_and_nothing_is_deleted(
    shm: Path, tmp_path: Path, given: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker points the victim's tier-0 directory at the victim's disk ``dirpath``:
    tier 0 would write there and its keep-1 retention delete the disk checkpoints. Refused:
    an error where the user named the directory, tier 0 off (loudly) for the default one."""
    dirpath = tmp_path / "ck"
    for step in (3, 5):
        _copy(dirpath, step, run_id="victim")
    dirpath.chmod(0o700)
    if given:
        root = shm / "job-7"
        link = root
    else:
        root = shm / f"lightning_preempt-{os.geteuid()}" / "run-0123456789ab"
        link = root.parent  # the base itself: the run directory's name is found inside it
        (dirpath / root.name).mkdir()

    as_user(OTHER_UID, lambda: link.symlink_to(dirpath))
    tier = memory_tier.MemoryTier(str(root), 2, keep=1)
    if given:
        with pytest.raises(CheckpointError, match=r"(?s)symbolic link.*HINT: "):
            tier.setup(None, leader=True)
    else:
        with caplog.at_level(logging.WARNING, logger="lightning_preempt"):
            assert not tier.setup(None, leader=True)
        assert "symbolic link" in caplog.text and "HINT: " in caplog.text
        assert tier.held() == []
    assert sorted(os.listdir(dirpath)) == sorted([checkpoint_name(3), checkpoint_name(5)] + ([] if given else [root.name]))
    assert _choice(dirpath, root) == str(dirpath / checkpoint_name(5))


@as_root
def test_a_memory_dirpath_another_user_made_is_an_error_with_a_hint(shm: Path) -> None:
    root = shm / "job-7"
    as_user(OTHER_UID, lambda: root.mkdir())
    with pytest.raises(CheckpointError, match=rf"(?s)owned by uid {OTHER_UID}.*HINT: "):
        memory_tier.MemoryTier(str(root), 2).setup(None, leader=True)
    assert os.listdir(root) == []


def test_a_group_writable_directory_of_ones_own_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "t0"
    root.mkdir()
    root.chmod(0o770)
    with pytest.raises(CheckpointError, match=r"(?s)group/other-writable.*HINT: "):
        memory_tier.MemoryTier(str(root), 2).setup(None, leader=True)



@as_root
def test_a_symlink_above_the_directory_is_followed_only_if_root_or_this_user_made_it(shm: Path, tmp_path: Path) -> None:
    """``memory_dirpath=/dev/shm/x/job`` with ``x`` a symlink: followed when root or this uid
    owns it (``/dev/shm -> /run/shm``), refused when another user planted it."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)  # this uid's own
    assert memory_tier.MemoryTier(str(tmp_path / "alias" / "job"), 2).setup(None, leader=True)
    assert stat.S_IMODE(os.stat(real / "job").st_mode) == 0o700
    as_user(OTHER_UID, lambda: (shm / "x").symlink_to(real))
    with pytest.raises(CheckpointError, match=rf"(?s)symbolic link owned by uid {OTHER_UID}.*HINT: "):
        memory_tier.MemoryTier(str(shm / "x" / "job2"), 2).setup(None, leader=True)
    assert sorted(os.listdir(real)) == ["job"]


def test_a_file_where_the_directory_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t0").write_bytes(b"not a directory")
    with pytest.raises(CheckpointError, match=r"(?s)is a regular file, not a directory.*HINT: "):
        memory_tier.MemoryTier(str(tmp_path / "t0"), 2).setup(None, leader=True)
