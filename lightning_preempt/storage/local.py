"""Local disk: the one durable write (:func:`write_atomic`), directory fsync, delete, and
reads that refuse anything but a regular file. Every recursive delete, here or in
storage/store.py, demands an :class:`Owned` for exactly its path (storage cannot tell what
this package wrote); the one issuer is :func:`lightning_preempt.catalog.ownership.check_owned`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import posixpath
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from typing import IO

#: Bytes, or a function that writes them into the open file (``torch.save``).
Payload = bytes | bytearray | memoryview | Callable[[IO[bytes]], None]


@dataclasses.dataclass(frozen=True)
class Owned:
    """A directory checked as this package's (``path``: the store's native path)."""

    path: str


class UncheckedRemoveError(PermissionError):
    """A recursive delete was asked for without the ownership check of that path (a bug)."""


def require(owned: Owned | None, path: str) -> None:
    """Raise :class:`UncheckedRemoveError` unless ``owned`` vouches for ``path``."""
    if owned is None or _norm(owned.path) != _norm(path):
        raise UncheckedRemoveError(
            f"refusing to delete the directory {path}: its ownership was not checked"
            + (f" (the check was for {owned.path})" if owned is not None else "")
        )


def _norm(path: str) -> str:
    return posixpath.normpath(path.replace("\\", "/")) if path else path


class NotRegularFileError(OSError):
    """A read was refused: the entry is a symlink, FIFO, device, socket or directory."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is {what}, not a regular file")
        self.what = what


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable; best effort (some file systems cannot)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def sync_data(fd: int) -> None:
    """``fdatasync`` (skips the timestamps ``fsync`` journals), ``fsync`` where it is missing."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


#: A temporary file of :func:`write_atomic`: made new, never through a planted symlink.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def durable_file(path: str, *, durable: bool = True, mode: int | None = None) -> Iterator[IO[bytes]]:
    """``path`` open for writing, synced once the block exits cleanly; not atomic (temporary
    files, or names nobody reads before a commit); a failure removes it. ``mode``: create
    ``path`` new (``O_EXCL | O_NOFOLLOW``: an entry already there, a symlink included, is
    ``FileExistsError``) with these permission bits (less the umask)."""
    # Opened before the clean-up applies: a create refused (an entry there) removes nothing.
    f = open(path, "wb") if mode is None else os.fdopen(os.open(path, _NEW_FILE, mode), "wb")  # noqa: SIM115
    try:
        with f:
            yield f
            f.flush()
            if durable:
                sync_data(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def write_durable(path: str, data: Payload, *, durable: bool = True, mode: int | None = None) -> None:
    """:func:`durable_file` holding ``data``."""
    with durable_file(path, durable=durable, mode=mode) as f:
        if callable(data):
            data(f)
        else:
            f.write(data)


def write_atomic(
    path: str,
    data: Payload,
    *,
    exclusive: bool = False,
    tmp_name: str | None = None,
    check: Callable[[str], None] | None = None,
    durable: bool = True,
    mode: int = 0o666,
) -> None:
    """Put ``data`` at ``path`` atomically: temp file, sync, link/replace, fsync the directory.

    The temp file is created new (``O_EXCL | O_NOFOLLOW``) with ``mode`` (less the umask;
    0600: private, storage/private.py): a symlink or file planted at its name is never
    written through. ``exclusive``: create-only (``FileExistsError``). ``tmp_name``: a name
    the caller's clean-up recognises. ``check(tmp)`` runs before the rename; raising aborts.
    ``durable=False`` skips both syncs (a crash may lose the file).
    """
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, tmp_name or f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    created = False
    try:
        write_durable(tmp, data, durable=durable, mode=mode)
        created = True
        if check is not None:
            check(tmp)
        _publish(tmp, path, exclusive=exclusive)
    finally:
        if created:  # never unlink what was there before (not ours: another writer's, a planted entry)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # after a link() the data lives on under its new name
    if durable:
        fsync_dir(directory)


def _publish(tmp: str, path: str, *, exclusive: bool) -> None:
    if not exclusive:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # atomic and create-only
    except FileExistsError:
        raise
    except OSError:  # no hard links on this file system: check, then rename (a small race)
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", path) from None
        os.replace(tmp, path)


def remove_local(path: str, *, owned: Owned | None = None) -> None:
    """Delete a file, symlink or tree (only with ``owned``), then fsync the parent."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        require(owned, path)
        shutil.rmtree(path)
    fsync_dir(os.path.dirname(path))


def _remove_tree(path: str, first: str | None) -> None:
    """``first`` (a commit marker) goes before the rest, so a half-deleted tree never looks committed."""
    if first is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, first))
    shutil.rmtree(path)


def replace_entry(path: str, new: str, aside: str, *, first: str | None = None, owned: Owned | None = None) -> None:
    """Put ``new`` at ``path``, file or directory either way: old moves to ``aside``, new moves
    in, then old is deleted, so a complete entry always exists. An old directory needs ``owned``."""
    had_old = os.path.lexists(path)
    old_is_tree = had_old and not os.path.islink(path) and os.path.isdir(path)
    if old_is_tree:
        require(owned, path)
    if had_old:
        os.rename(path, aside)
    os.rename(new, path)
    fsync_dir(os.path.dirname(path))
    if old_is_tree:
        _remove_tree(aside, first)
        fsync_dir(os.path.dirname(path))
    elif had_old:
        remove_local(aside)


def open_regular(path: str) -> IO[bytes]:
    """Open ``path`` only if it is a regular file; ``O_NONBLOCK`` so a FIFO cannot hang, no race."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP or (err.errno == errno.EMLINK and os.path.islink(path)):
            raise NotRegularFileError(path, "a symbolic link") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(path, describe_mode(mode))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def scan(path: str) -> list[tuple[str, str, int | None]]:
    """``(name, kind, size)`` directly in ``path``, symlinks not followed; an entry deleted
    while listed (another rank's probe) is left out."""
    try:
        with os.scandir(path) as it:
            found = [(e.name, kind) for e in it if (kind := _kind_and_size(e)) is not None]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((name, *kind) for name, kind in found)


#: Only these mean "absent"; EIO, EACCES… are raised: taken for absent, a committed
#: checkpoint would look partial.
_ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG})


def stat_entry(path: str) -> tuple[str, int | None] | None:
    """``(kind, size)`` of ``path`` through symlinks, ``None`` when absent."""
    try:
        st = os.stat(path)
    except ValueError:  # a NUL in the path: no entry can have that name
        return None
    except OSError as err:
        if err.errno in _ABSENT_ERRNOS:
            return None
        raise
    return _mode_kind(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else None


def regular_size(path: str) -> int:
    mode, size = (st := os.lstat(path)).st_mode, st.st_size
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(path, describe_mode(mode))
    return size


def _kind_and_size(entry: os.DirEntry[str]) -> tuple[str, int | None] | None:
    try:
        if entry.is_symlink():
            return "link", None
        if entry.is_dir(follow_symlinks=False):
            return "dir", None
        if entry.is_file(follow_symlinks=False):
            return "file", entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        return None
    return "other", None


_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "link"}
_WHAT = {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory",
         stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}  # fmt: skip


def _mode_kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "other")


def describe_mode(mode: int) -> str:
    return _WHAT.get(stat.S_IFMT(mode), "not a regular file")
