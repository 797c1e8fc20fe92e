"""A real fsspec filesystem that fails on purpose: ``faulty://`` (memory-backed).

Writes raise ``OSError`` once ``FaultyFileSystem.fail_after_bytes`` bytes were written
in total (``None``: never). Used to inject storage failures mid-flush without mocks.
:class:`FailingStat`: ``EIO`` from ``os.stat`` of chosen local paths (an NFS/FUSE hiccup).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem


class _FaultyFile(MemoryFile):
    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        FaultyFileSystem.written += n
        limit = FaultyFileSystem.fail_after_bytes
        if limit is not None and FaultyFileSystem.written > limit:
            raise OSError(28, "No space left on device (injected)")
        return super().write(data)


class FaultyFileSystem(MemoryFileSystem):
    protocol = "faulty"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    fail_after_bytes: ClassVar[int | None] = None
    written: ClassVar[int] = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if path.startswith("faulty://"):
            path = path[len("faulty://") :]
        return super()._strip_protocol(path)  # type: ignore[no-any-return]

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if "w" in mode:
            f.__class__ = _FaultyFile  # same object, writes counted and failed on demand
        return f

    @classmethod
    def reset(cls, fail_after_bytes: int | None = None) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.fail_after_bytes = fail_after_bytes
        cls.written = 0


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


class FailingStat:
    """``os.stat`` of local paths ending in ``suffix`` fails with ``EIO`` (``times`` calls,
    ``None``: every call): what NFS or FUSE answers in a hiccup, which nothing else on a
    test machine produces. Other paths are untouched. Use as a context manager."""

    def __init__(self, suffix: str, times: int | None = None, errno_: int = 5) -> None:
        self.suffix, self.times, self.errno = suffix, times, errno_
        self.failed = 0
        self._real = os.stat

    def _stat(self, path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        ours = isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(self.suffix)
        if ours and (self.times is None or self.failed < self.times):
            self.failed += 1
            raise OSError(self.errno, f"{os.strerror(self.errno)} (injected)", os.fspath(path))
        return self._real(path, *args, **kwargs)

    def __enter__(self) -> FailingStat:
        os.stat = self._stat  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.stat = self._real  # type: ignore[assignment]
