"""``slow://`` — ``chaos://`` (local disk, paths shared by processes) behind a bandwidth limit.

A stand-in for a bucket reached over a thin link: every byte written (data files,
manifests, leases) waits ``bytes / rate`` seconds, with the rate (bytes per second) read
from ``$LP_SLOW_DIR/rate`` on every write, so a test can throttle the remote at a chosen
moment. No file, or 0: unlimited. Reads are not limited.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import fsspec
from chaos_fs import ChaosFileSystem


def set_rate(ctl: str | Path, bytes_per_s: float) -> None:
    Path(ctl).mkdir(parents=True, exist_ok=True)
    tmp = Path(ctl, "rate.tmp")
    tmp.write_text(str(bytes_per_s))
    os.replace(tmp, Path(ctl, "rate"))


def _wait(nbytes: int) -> None:
    ctl = os.environ.get("LP_SLOW_DIR")
    if not ctl or nbytes <= 0:
        return
    try:
        rate = float(Path(ctl, "rate").read_text())
    except (FileNotFoundError, ValueError):
        return
    if rate > 0:
        time.sleep(nbytes / rate)


class _Throttled:
    """A writable file whose ``write`` takes as long as the link needs for the bytes."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write(self, b: Any) -> int:
        _wait(memoryview(b).nbytes)
        return int(self._inner.write(b))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _Throttled:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


class ThrottledFileSystem(ChaosFileSystem):
    protocol = "slow"

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        return f if "r" in mode else _Throttled(f)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        _wait(len(value))
        super().pipe_file(path, value, mode=mode, **kwargs)


fsspec.register_implementation("slow", ThrottledFileSystem, clobber=True)
