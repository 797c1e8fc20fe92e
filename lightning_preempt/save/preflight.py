"""Fail fast: check at ``setup`` that a rank can write, list and delete in a checkpoint root.

A read-only or unreachable dirpath found at the first periodic save costs a whole save
interval of training; found at a preemption, it costs the snapshot. Each rank creates a
small probe object (it writes its own shard later), lists the root, and deletes the object.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from lightning_preempt.errors import CheckpointError, CheckpointWriteError
from lightning_preempt.format.names import PROBE_PREFIX
from lightning_preempt.storage.diagnose import describe, storage_hint
from lightning_preempt.storage.protocols import protocol_of
from lightning_preempt.storage.store import Store

_NOTHING_LOST = "Training has not started, so nothing is lost."


def check_writable(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Create, list and delete ``<url>/.lp-probe-…``; raise :class:`CheckpointWriteError` with
    a HINT naming the step that failed and what to change."""
    name = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    step = "opening the storage"
    try:
        store = Store(url, storage_options)
        in_the_way = _file_in_the_way(store.path()) if store.is_local else None
    except Exception as err:
        raise _unusable(url, step, err, storage_options) from err
    if in_the_way is not None:
        raise CheckpointWriteError(
            f"the checkpoint storage is not usable: {in_the_way} is a file, not a directory",
            path=url,
            hint=f"{_NOTHING_LOST} dirpath (and local_dirpath) name a directory for the checkpoints (created when "
            "missing), never an existing file: pass a directory path. The file was left as it is.",
        )
    try:
        step = "creating the directory"
        store.makedirs()
        step = "writing a probe file"
        store.commit_bytes(name, b"lightning_preempt write probe\n", exclusive=False)
        step = "listing the directory"
        if name not in {e.name for e in store.entries()}:  # one listing of the root, not of every checkpoint
            raise FileNotFoundError(f"the probe file {name} does not show up in the listing")
        step = "deleting the probe file"
        store.rm_file(name)
    except Exception as err:
        raise _unusable(url, step, err, storage_options) from err


def _unusable(url: str, step: str, err: BaseException, options: dict[str, Any] | None) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"the checkpoint storage is not usable: {step} failed ({describe(err, options or {})})",
        path=url,
        hint=f"{_NOTHING_LOST} {_what_to_change(url, step, err)}",
    )


def _file_in_the_way(path: str) -> str | None:
    """The file (``path`` itself or one of its parents) where a directory must be, or ``None``."""
    path = os.path.abspath(path)
    while True:
        if os.path.exists(path):
            return None if os.path.isdir(path) else path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _what_to_change(url: str, step: str, err: BaseException) -> str:
    if isinstance(err, CheckpointError) and err.hint:
        return err.hint  # says what to set already (credentials, a missing bucket…)
    if step == "listing the directory":
        return (
            "The storage did not list a file just written to it. Use storage whose listings are consistent, or "
            "pass probe_storage=False if it shows new files late."
        )
    if protocol_of(url) != "file":
        return storage_hint(url, err)
    return "Make it a directory that every rank can write, list and delete in (permissions, free space)."
