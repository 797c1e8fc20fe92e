"""A real fsspec filesystem that "crashes" at a chosen moment: ``crashfs://`` (memory-backed).

Every mutating operation (opening a file for writing, closing it, ``pipe_file``,
removing, moving, creating a directory) counts as one *moment*. With
``CrashFileSystem.crash_at = k`` the k-th moment and every later one raise
:class:`SimulatedCrash` (a ``BaseException``, so no ``except Exception`` clean-up path
runs) and change nothing: what the store holds afterwards is exactly what a process
killed at that moment leaves. Like an object store, a file appears only when it is
closed (never half-written). ``fail_removes`` makes removals raise ``OSError`` instead.
"""

from __future__ import annotations

from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem


class SimulatedCrash(BaseException):
    """The process "died" here; nothing after this moment happens."""


def _dead() -> bool:
    fs = CrashFileSystem
    return fs.crash_at is not None and len(fs.moments) > fs.crash_at


def _moment(what: str) -> None:
    fs = CrashFileSystem
    fs.moments.append(what)
    if fs.crash_at is not None and len(fs.moments) > fs.crash_at:
        raise SimulatedCrash(what)


class _CrashFile(MemoryFile):
    def write(self, data: Any) -> int:
        if _dead():
            raise SimulatedCrash(f"write {self.path}")
        return super().write(data)

    def close(self) -> None:
        if not self.closed and "w" in getattr(self, "_crash_mode", ""):
            _moment(f"close {self.path}")
        super().close()

    def __del__(self) -> None:
        """A file the "dead" process left open is never closed later: io's finalizer would
        call :meth:`close` whenever the garbage collector runs, counting a moment in another
        trial's replacement (its crash then came one operation early: the trials' "old until
        the commit, new from then on" failed about once per full suite) and, unarmed, putting
        the dead process's partial file into the store."""


class CrashFileSystem(MemoryFileSystem):
    protocol = "crashfs"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    crash_at: ClassVar[int | None] = None
    fail_removes: ClassVar[bool] = False
    moments: ClassVar[list[str]] = []

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if path.startswith("crashfs://"):
            path = path[len("crashfs://") :]
        return super()._strip_protocol(path)  # type: ignore[no-any-return]

    @classmethod
    def reset(cls) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.crash_at = None
        cls.fail_removes = False
        cls.moments = []

    @classmethod
    def arm(cls, crash_at: int | None) -> None:
        """Count moments from now; crash at the ``crash_at``-th (``None``: only count)."""
        cls.moments = []
        cls.crash_at = crash_at

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode or "a" in mode or "x" in mode:
            _moment(f"open {path}")
        f = super()._open(path, mode, **kwargs)
        if "w" in mode or "a" in mode or "x" in mode:
            f.__class__ = _CrashFile
            f._crash_mode = "w"
        return f

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        _moment(f"pipe {path}")
        super().pipe_file(path, value, mode=mode, **kwargs)

    def _removal(self, what: str) -> None:
        _moment(what)
        if CrashFileSystem.fail_removes:
            raise OSError(13, f"Permission denied (injected): {what}")

    def rm_file(self, path: str) -> None:
        self._removal(f"rm_file {path}")
        super().rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._removal(f"rm {path}")
        super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def rmdir(self, path: str) -> None:
        self._removal(f"rmdir {path}")
        super().rmdir(path)

    def mv(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> None:
        _moment(f"mv {path1} {path2}")
        super().mv(path1, path2, *args, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        _moment(f"makedirs {path}")
        super().makedirs(path, exist_ok=exist_ok)


fsspec.register_implementation("crashfs", CrashFileSystem, clobber=True)
