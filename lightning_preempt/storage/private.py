"""Private local files on shared ground (tier 0 under ``/dev/shm``): the one home of the
checks that keep another local user out (docs/security.md, "Tier 0 on a shared host").

A directory tree is *private* when no other uid can change any component of its path:

* **Ancestors** (the part of the path this package does not own, e.g. ``/dev/shm``): each
  is owned by root or by this uid, and is not group/other-writable unless sticky (``/tmp``,
  ``/dev/shm``: others may add entries there but not rename or delete ours). A symlink among
  them is followed only when root or this uid owns it (``/dev/shm -> /run/shm``); one
  planted by another uid is refused.
* **Own components** (the last ``own`` ones: the per-user base and the run directory): made
  with ``mkdir`` 0700 from the parent's file descriptor, opened ``O_NOFOLLOW | O_DIRECTORY``
  and checked with ``fstat``: a directory owned by this uid, not group/other-writable;
  anything else (a symlink, a FIFO, another uid's directory) is refused, never followed. A
  group/other-*readable* one of ours is tightened to 0700 (``fchmod`` on the checked fd).

Once a path passed, only root and this uid can change any of its components, so the save
pipeline may use it by name afterwards. Files made here are 0600, created ``O_EXCL |
O_NOFOLLOW`` under a random temporary name (storage/local.py ``write_atomic``) and read only
if regular, ours and not group/other-writable (``O_NONBLOCK``: a FIFO cannot hang a reader).
"""

from __future__ import annotations

import contextlib
import os
import stat

from lightning_preempt.storage import local

#: Each user's own tier-0 base under a shared tmpfs: ``<parent>/lightning_preempt-<uid>``.
BASE_PREFIX = "lightning_preempt-"
#: What to do about a refused path (the caller adds what it decided: tier 0 off, or an error).
PRIVATE_HINT = (
    "Tier 0 writes only under a directory this user owns (mode 0700) on a path no other user can "
    "change: remove or rename the directory named (as its owner or root), or set memory_dirpath to "
    "a directory of your own, e.g. /dev/shm/$USER-job (docs/security.md, 'Tier 0 on a shared host')."
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_MAX_LINKS = 40  # symlinks followed among the ancestors (the kernel's own limit)


class UnsafePathError(OSError):
    """A tier-0 path another local user could control: refused, never followed."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path} {why}")
        self.path, self.why = path, why


def user_base(parent: str = "/dev/shm") -> str:
    """This uid's tier-0 base under the shared tmpfs ``parent``."""
    return os.path.join(parent.rstrip("/") or "/", f"{BASE_PREFIX}{os.geteuid()}")


def private_dirs(path: str, *, own: int = 1, create: bool = True) -> None:
    """Make (``create``) or check ``path`` as private (module docstring): its last ``own``
    components are this uid's directories, 0700; every other component is an ancestor no
    other uid can change. Raises :class:`UnsafePathError` (what is wrong with which
    component), ``FileNotFoundError`` (``create=False``, absent) or another ``OSError``."""
    if own < 1:
        raise ValueError("own must be >= 1")
    parts = _parts(path)
    if len(parts) < own:
        raise UnsafePathError(path, "has fewer components than the directories to own")
    fd = _trusted_parent(parts[:-own], path, create=create)
    for i in range(len(parts) - own, len(parts)):  # _own_child closes the parent's fd
        fd = _own_child(fd, parts[i], "/" + "/".join(parts[: i + 1]), create=create)
    os.close(fd)


def read_private(path: str, max_bytes: int = 1 << 20) -> bytes:
    """The bytes of ``path`` if it is a regular file of this uid that no other can write
    (never a symlink, FIFO or device: ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``)."""
    with local.open_regular(path) as f:
        why = _not_ours(os.fstat(f.fileno()))
        if why:
            raise UnsafePathError(path, why)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafePathError(path, f"is larger than {max_bytes} bytes")
    return data


def write_private(path: str, data: bytes) -> None:
    """Put ``data`` at ``path`` atomically, mode 0600, never through a planted symlink: a
    random temporary name created ``O_EXCL | O_NOFOLLOW``, then ``rename`` (which replaces a
    symlink at ``path`` itself, never its target). Not synced: tier 0 lives in RAM."""
    local.write_atomic(path, data, mode=0o600, durable=False)


def _parts(path: str) -> list[str]:
    return [p for p in os.path.abspath(path).split("/") if p]


def _trusted_parent(parts: list[str], whole: str, links: int = 0, *, create: bool = False) -> int:
    """An fd of the directory ``/parts...``, every component checked as an ancestor (one
    absent is made 0700, ours, with ``create``: ``memory_dirpath=/dev/shm/me/job-7``)."""
    fd = os.open("/", _DIR_FLAGS)
    here = "/"
    try:
        for i, name in enumerate(parts):
            child = os.path.join(here, name)
            st_or_none = _lstat_or_none(name, fd)
            if st_or_none is None and create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in (0, os.geteuid()):
                    raise UnsafePathError(child, f"is a symbolic link owned by uid {st.st_uid}, another user")
                if links >= _MAX_LINKS:
                    raise UnsafePathError(whole, "has too many symbolic links")
                target = os.path.join(here, os.readlink(name, dir_fd=fd))
                os.close(fd)
                fd = -1
                return _trusted_parent(_parts(target) + parts[i + 1 :], whole, links + 1, create=create)
            nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            why = _not_trusted(os.fstat(fd))
            if why:
                raise UnsafePathError(child, why)
            here = child
        return fd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def _own_child(parent: int, name: str, shown: str, *, create: bool) -> int:
    """The fd of ``name`` in ``parent`` (made 0700 if absent and ``create``), checked as ours;
    closes ``parent``."""
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError:
            st = _lstat_or_none(name, parent)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                what = "a regular file" if stat.S_ISREG(st.st_mode) else local.describe_mode(st.st_mode)
                raise UnsafePathError(shown, f"is {what}, not a directory") from None
            raise
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        why = _not_ours(st)
        if why:
            raise UnsafePathError(shown, why)
        if st.st_mode & 0o077:  # ours, writable by nobody else: only tightened
            os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _lstat_or_none(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _not_ours(st: os.stat_result) -> str:
    """Why an entry of ours is not private ('' when it is)."""
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is group/other-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def _not_trusted(st: os.stat_result) -> str:
    """Why an ancestor directory is one another uid could change ('' when it is not)."""
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}, another user"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"is group/other-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o})"
    return ""
