"""A real fsspec filesystem that fails on purpose: ``faulty://`` (memory-backed).

Writes raise ``OSError`` once ``FaultyFileSystem.fail_after_bytes`` bytes were written
in total (``None``: never). Used to inject storage failures mid-flush without mocks.
"""

from __future__ import annotations

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
