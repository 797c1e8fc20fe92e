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

from lightning_preempt.errors import CheckpointWriteError
from lightning_preempt.format.names import PROBE_PREFIX
from lightning_preempt.storage.store import Store


def check_writable(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Create, list and delete ``<url>/.lp-probe-…``; raise :class:`CheckpointWriteError` with
    a HINT naming the step that failed."""
    store = Store(url, storage_options)
    name = f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    step = "creating the directory"
    try:
        store.makedirs()
        step = "writing a probe file"
        store.commit_bytes(name, b"lightning_preempt write probe\n", exclusive=False)
        step = "listing the directory"
        if name not in {e.name for e in store.entries()}:  # one listing of the root, not of every checkpoint
            raise FileNotFoundError(f"the probe file {name} does not show up in the listing")
        step = "deleting the probe file"
        store.rm_file(name)
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else ""
        raise CheckpointWriteError(
            f"the checkpoint storage is not usable: {step} failed ({type(err).__name__}: {text})",
            path=url,
            hint="Training has not started, so nothing is lost. Make dirpath (and local_dirpath) writable, "
            "listable and deletable by every rank (permissions, credentials in storage_options or the "
            "environment, bucket name, free space), or pass probe_storage=False to skip this check.",
        ) from err
