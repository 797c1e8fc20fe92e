"""``chaos://`` — a real fsspec filesystem on local disk that fails on command.

Paths are local (``chaos:///tmp/run`` is ``/tmp/run``) so several processes share it, but it
is *not* a ``LocalFileSystem``: the package treats it like an object store client (writes
go through ``fs.open`` / ``pipe_file``), so every storage operation can be failed.

Faults are switched on by files in ``$LP_CHAOS_DIR`` (processes read them on every call):
``<op>`` holds JSON ``{"ranks": [0, 2] | null, "times": N | null, "hang_s": S | null}``;
``ranks`` limits the fault to those ranks (``$RANK``, else ``$LOCAL_RANK``, else 0), ``times``
to the first N calls of each rank (counted in ``<op>.rank<R>.count``), ``hang_s`` sleeps
instead of failing. Ops: ``list`` (ls/find), ``exists`` (exists/info/isdir), ``read``,
``write`` (data files), ``commit`` (create-only writes: manifests, leases), ``makedirs``, ``rm``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

OPS = ("list", "exists", "read", "write", "commit", "makedirs", "rm")


def set_fault(ctl: str | Path, op: str, *, ranks: list[int] | None = None, times: int | None = None,
              hang_s: float | None = None, exc: str | None = None) -> None:  # fmt: skip
    """Switch a fault on (from the test process); ``exc="RuntimeError"`` raises that instead of OSError."""
    assert op in OPS, op
    Path(ctl).mkdir(parents=True, exist_ok=True)
    Path(ctl, op).write_text(json.dumps({"ranks": ranks, "times": times, "hang_s": hang_s, "exc": exc}))


def clear_faults(ctl: str | Path) -> None:
    for p in Path(ctl).glob("*"):
        p.unlink()


def _rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


def _maybe_fail(op: str, path: str) -> None:
    ctl = os.environ.get("LP_CHAOS_DIR")
    if not ctl:
        return
    spec_file = Path(ctl, op)
    try:
        spec = json.loads(spec_file.read_text())
    except (FileNotFoundError, ValueError):
        return
    rank = _rank()
    if spec.get("ranks") is not None and rank not in spec["ranks"]:
        return
    if spec.get("times") is not None:
        counter = Path(ctl, f"{op}.rank{rank}.count")
        done = int(counter.read_text()) if counter.exists() else 0
        if done >= spec["times"]:
            return
        counter.write_text(str(done + 1))
    if spec.get("hang_s"):
        time.sleep(spec["hang_s"])
        return
    if spec.get("exc") == "RuntimeError":  # a driver error that is not an OSError (botocore, google-auth)
        raise RuntimeError(f"driver failure (injected: {op} on rank {rank})")
    raise OSError(5, f"Input/output error (injected: {op} on rank {rank})", path)


class ChaosFileSystem(AbstractFileSystem):
    protocol = "chaos"
    root_marker = "/"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        """``<protocol>://a/b`` -> ``/a/b`` (for subclasses with another protocol too)."""
        path = str(path)
        prefix = f"{cls.protocol}://"
        if path.startswith(prefix):
            path = path[len(prefix) :]
        return "/" + path.lstrip("/") if path else "/"

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        _maybe_fail("list", path)
        return self.local.ls(self._strip_protocol(path), detail=detail, **kwargs)

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        _maybe_fail("list", path)
        return self.local.find(self._strip_protocol(path), *args, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        _maybe_fail("exists", path)
        return dict(self.local.info(self._strip_protocol(path), **kwargs))

    def exists(self, path: str, **kwargs: Any) -> bool:
        _maybe_fail("exists", path)
        return bool(self.local.exists(self._strip_protocol(path)))

    def isdir(self, path: str) -> bool:
        _maybe_fail("exists", path)
        return bool(self.local.isdir(self._strip_protocol(path)))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        _maybe_fail("makedirs", path)
        self.local.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        _maybe_fail("makedirs", path)
        self.local.mkdir(self._strip_protocol(path), create_parents=create_parents, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        local = self._strip_protocol(path)
        if "r" in mode:
            _maybe_fail("read", path)
        else:
            _maybe_fail("write", path)
            os.makedirs(os.path.dirname(local), exist_ok=True)
        return self.local._open(local, mode)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        _maybe_fail("commit" if mode == "create" else "write", path)
        local = self._strip_protocol(path)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        if mode == "create":
            with open(local, "xb") as f:  # FileExistsError: the create-only contract
                f.write(value)
        else:
            with open(local, "wb") as f:
                f.write(value)

    def rm_file(self, path: str) -> None:
        _maybe_fail("rm", path)
        self.local.rm_file(self._strip_protocol(path))

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        _maybe_fail("rm", str(path))
        self.local.rm(self._strip_protocol(str(path)), recursive=recursive, maxdepth=maxdepth)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        _maybe_fail("read", path)
        return bytes(self.local.cat_file(self._strip_protocol(path), start=start, end=end))


fsspec.register_implementation("chaos", ChaosFileSystem, clobber=True)
