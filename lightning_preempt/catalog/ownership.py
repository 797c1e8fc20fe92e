"""What under a checkpoint root is ours to delete (docs/security.md).

Storage is shared: a user's ``dataset/``, ``notes-step3/``, a Lightning FSDP
``epoch=0-step=100.ckpt/`` or a file dropped into one of our directories must survive
retention and clean-up. So this package deletes a directory only when

* its name is one this package gives (:func:`is_our_dir_name`: ``step-NNNNNNNNNN``, or
  with the 8-hex suffix the callback adds when a committed ``step-N`` exists), when the
  caller chose it by name (retention); and
* everything in it is a file this package writes (:func:`foreign_entries` is empty):
  the manifest, DCP shards (``*.distcp``) and ``.metadata``, per-rank state files, a
  commit's temporary manifest, the path marker, and generation directories holding only
  such files. An empty directory is an uncommitted leftover of ours.

Nothing is followed through a symlink; a symlink is never ours.
"""

from __future__ import annotations

import logging
import os
import re

from lightning_preempt.errors import (
    CheckpointExistsError,
)
from lightning_preempt.format.manifest import MANIFEST_NAME, is_checkpoint_file_name
from lightning_preempt.storage.store import Store

log = logging.getLogger(__name__)

#: ``step-0000000042`` and ``step-0000000042-1a2b3c4d`` (see ``discovery.checkpoint_name``).
OUR_DIR_RE = re.compile(r"step-(\d{10,19})(?:-[0-9a-f]{8})?")
#: Generation directories of a replaced checkpoint (``layout.py``).
GENERATION_RE = re.compile(r"v-[0-9a-f]{12}")
#: Other files this package leaves in a checkpoint directory: a local commit's temporary
#: manifest, the zero-byte marker that makes a path exist on object stores, and partial
#: DCP output of a killed save (any ``*.distcp``: the extension is DCP's own).
_OTHER_FILES_RE = re.compile(r"\.manifest\.json\.[0-9a-f]+\.tmp|\.lightning_preempt|[^/]+\.distcp|\.metadata\.tmp")

_HINT = (
    "lightning_preempt deletes only directories it wrote whose every file is one of its own. Move your "
    "files out of it (or delete the directory yourself), and keep other data out of the checkpoint dirpath. "
    "See docs/security.md."
)


def is_our_dir_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint directory name this package gives."""
    return OUR_DIR_RE.fullmatch(name) is not None


def dir_step(name: str) -> int | None:
    """The step in one of our directory names, or ``None`` for any other name."""
    match = OUR_DIR_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def is_our_file_name(name: str) -> bool:
    """A file this package writes directly in a checkpoint directory."""
    return name == MANIFEST_NAME or is_checkpoint_file_name(name) or _OTHER_FILES_RE.fullmatch(name) is not None


def foreign_entries(store: Store) -> list[str]:
    """Entries in the checkpoint directory ``store`` that this package did not write
    (``name`` or ``name (kind)``); empty when all of it is ours or it does not exist."""
    if store.is_local and os.path.islink(store.path()):
        return [f"{store.path()} (a symlink)"]
    foreign = []
    for name, kind in store.children():
        if kind == "file" and is_our_file_name(name):
            continue
        if kind == "dir" and GENERATION_RE.fullmatch(name):
            inner = [
                f"{name}/{n}" + ("" if k == "file" else f" ({k})")
                for n, k in store.children(name)
                if not (k == "file" and is_our_file_name(n))
            ]
            foreign.extend(inner)
            continue
        foreign.append(name if kind == "file" else f"{name} ({kind})")
    return foreign


def remove_if_ours(store: Store, *, why: str) -> None:
    """Delete the checkpoint directory ``store`` (manifest first, so a half-deleted one is
    never committed) and log it at INFO, or raise :class:`CheckpointExistsError` with a
    HINT when it holds anything this package did not write."""
    foreign = foreign_entries(store)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CheckpointExistsError(
            f"refusing to delete {store.url}: it holds things lightning_preempt did not write ({shown})",
            path=store.url,
            hint=_HINT,
        )
    store.rm_file(MANIFEST_NAME)
    store.rm_tree()
    log.info("lightning_preempt: deleted %s (%s)", store.url, why)

def remove_checkpoint_dir(store: Store) -> None:
    """Delete a checkpoint: the manifest first, so a half-deleted one is never committed.

    Raises :class:`~lightning_preempt.errors.CheckpointExistsError` (nothing deleted)
    when the directory holds anything this package did not write.
    """
    remove_if_ours(store, why="removal requested")
