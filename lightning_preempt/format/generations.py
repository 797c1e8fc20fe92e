"""Where a committed checkpoint's files live: beside its manifest, or in the generation
directory its manifest names (a checkpoint replaced at the same path, see write/replace.py).
"""

from __future__ import annotations

from lightning_preempt.errors import CorruptCheckpointError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import is_generation
from lightning_preempt.storage.store import Store

#: The manifest ``extra`` key naming the generation directory that holds the files.
DATA_DIR_KEY = "data_dir"


def generation_of(manifest: Manifest, *, path: str) -> str | None:
    """The generation directory ``manifest`` names, or ``None`` (files are beside it)."""
    value = manifest.extra.get(DATA_DIR_KEY)
    if value is None:
        return None
    if not isinstance(value, str) or not is_generation(value):
        # Never follow an arbitrary path out of the checkpoint (``../..``).
        raise CorruptCheckpointError(
            f"manifest names an invalid data directory {value!r}",
            path=path,
            hint="The checkpoint is damaged or was not written by lightning_preempt; resume from an older one.",
        )
    return value


def data_store(store: Store, manifest: Manifest) -> Store:
    """The store under which the files ``manifest`` lists live: ``store`` itself or its
    live generation directory. Every reader of a checkpoint's files resolves them here."""
    generation = generation_of(manifest, path=store.url)
    return store.child(generation) if generation else store

