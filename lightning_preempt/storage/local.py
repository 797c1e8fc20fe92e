"""Local disk: the one durable write, the one ``fsync`` of a directory, the one delete, and
reads that refuse anything but a regular file.

Every durable local write in this package goes through :func:`write_atomic` (commits,
plain Lightning files, the peer replica's copies, ``export``): a temporary file in the
same directory, ``fdatasync``, then ``os.replace`` (or ``os.link``, which is create-only), then
``fsync`` of the directory, so after a crash the name holds the old bytes or all of the
new ones, never a torn file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from typing import IO

from lightning_preempt.storage.owned import Owned, require

#: What :func:`write_atomic` and :func:`write_durable` write: bytes, or a function that
#: writes them into the open file (``torch.save``).
Payload = bytes | bytearray | memoryview | Callable[[IO[bytes]], None]


class NotRegularFileError(OSError):
    """A read was refused: the entry is a symlink, FIFO, device, socket or directory."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is {what}, not a regular file")
        self.what = what


def fsync_dir(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable (POSIX needs the directory fsynced).

    Best effort: some file systems cannot open or fsync a directory; the data itself is
    already durable then (it was fsynced before the rename)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_data(fd: int) -> None:
    """Make a file's bytes durable: ``fdatasync`` (the data and the size needed to read it
    back, without the timestamps ``fsync`` also journals), ``fsync`` where it is missing."""
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def write_durable(path: str, data: Payload, *, durable: bool = True) -> None:
    """Write ``data`` to ``path`` (created or truncated) and sync it (unless ``durable`` is
    false). Not atomic: only for names nobody reads yet (temporary files); a failure removes
    the partial file."""
    try:
        with open(path, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            if durable:
                sync_data(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def write_atomic(
    path: str,
    data: Payload,
    *,
    exclusive: bool = False,
    tmp_name: str | None = None,
    check: Callable[[str], None] | None = None,
    durable: bool = True,
) -> None:
    """Put a file holding ``data`` at ``path``: readers see the old entry or all of the new
    file, and after this returns the new file survives a crash (with ``durable``).

    Args:
        exclusive: create-only: raise ``FileExistsError`` (nothing changed) when ``path``
            exists; the caller decides what that means (the same bytes may count as success).
        tmp_name: the temporary file's name in ``path``'s directory (a name the caller's
            clean-up recognises); default ``.{name}.{32 hex}.tmp``.
        check: called with the temporary file's path once it is durable and before it gets
            its name (``export`` scans the pickle there); raising aborts the write.
        durable: ``False`` skips both syncs: still atomic and create-only for the processes
            running now, but a crash may lose the file (the writer claim: a lost claim is as
            good as a stale one, write/replace.py).
    """
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, tmp_name or f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        write_durable(tmp, data, durable=durable)
        if check is not None:
            check(tmp)
        _publish(tmp, path, exclusive=exclusive)
    finally:
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


def remove_local(path: str, *, first: str | None = None, owned: Owned | None = None) -> None:
    """Delete a local file, a symlink (only the link) or a directory tree, then fsync the parent.

    A directory is deleted only with ``owned``, the ownership verdict for ``path``
    (storage/owned.py); without it :class:`UncheckedRemoveError` is raised, nothing deleted.
    ``first``: a name inside a directory deleted before anything else (a commit marker:
    the directory then never looks committed while half deleted).
    """
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        require(owned, path)
        _remove_tree(path, first)
    fsync_dir(os.path.dirname(path))


def _remove_tree(path: str, first: str | None) -> None:
    if first is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, first))
    shutil.rmtree(path)


def replace_entry(path: str, new: str, aside: str, *, first: str | None = None, owned: Owned | None = None) -> None:
    """Put the entry at ``new`` (same file system) at ``path``, whatever kind of entry each is
    (a plain file replaced by a checkpoint directory, or the other way round).

    Two renames: the old entry moves to ``aside``, the new one moves in, the directory is
    fsynced, then the old one is deleted (``first`` first, see :func:`remove_local`). At every
    moment a complete entry exists, at ``path`` or at ``aside``. An old *directory* is
    replaced only with ``owned``, its ownership verdict; checked before anything moves.
    """
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
    """Open ``path`` for reading only if it is a regular file, not through a symlink.

    ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat`` on the open descriptor (no race): a symlink,
    FIFO (which would block the open), socket or device raises
    :class:`NotRegularFileError`. A missing file raises ``FileNotFoundError``.
    """
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
    """``(name, kind, size)`` of every entry directly in ``path``, symlinks not followed;
    ``kind``: ``"file"`` (regular), ``"dir"``, ``"link"`` or ``"other"``; ``size`` for
    regular files. Empty when ``path`` does not exist or is not a directory. An entry
    deleted while it is listed (another rank's probe file) is left out, never the listing."""
    try:
        with os.scandir(path) as it:
            found = [(e.name, kind) for e in it if (kind := _kind_and_size(e)) is not None]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((name, *kind) for name, kind in found)


#: ``stat`` errors that mean "nothing is there": no such entry, a parent that is not a
#: directory, a symlink that resolves to nothing (or loops). Any other error (EIO on NFS or
#: FUSE, EACCES, ESTALE…) means "could not tell" and is raised: taken for "absent" it makes
#: a committed checkpoint look partial (resume from step 0, retention deleting it).
_ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG})


def stat_entry(path: str) -> tuple[str, int | None] | None:
    """``(kind, size)`` of ``path`` through symlinks (see :func:`scan`), or ``None`` when
    nothing is there. An error that does not say "absent" (EIO, EACCES…) is raised."""
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
    """The size of the regular file ``path``, not through a symlink (no data read);
    :class:`NotRegularFileError` for anything else, ``FileNotFoundError`` when missing."""
    mode, size = (st := os.lstat(path)).st_mode, st.st_size
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(path, describe_mode(mode))
    return size


def _kind_and_size(entry: os.DirEntry[str]) -> tuple[str, int | None] | None:
    """``(kind, size)``, or ``None`` when the entry is gone by the time it is looked at."""
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


def _mode_kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "link" if stat.S_ISLNK(mode) else "other"


def describe_mode(mode: int) -> str:
    """What a non-regular entry is, for messages ("a FIFO")."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"
