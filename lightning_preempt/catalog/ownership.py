"""What under a checkpoint root is ours to delete (docs/security.md).

Storage is shared: a user's ``dataset/``, ``notes-step3/``, a Lightning FSDP
``epoch=0-step=100.ckpt/`` or a file dropped into one of our directories must survive
retention and clean-up. So this package deletes a directory only when

* its name is one this package gives (``names.is_our_dir_name``: ``step-NNNNNNNNNN``, or
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

from lightning_preempt.errors import CheckpointExistsError
from lightning_preempt.format.names import MANIFEST_NAME, is_generation, is_our_file
from lightning_preempt.storage.store import Store

log = logging.getLogger(__name__)

_HINT = (
    "lightning_preempt deletes only directories it wrote whose every file is one of its own. Move your "
    "files out of it (or delete the directory yourself), and keep other data out of the checkpoint dirpath. "
    "See docs/security.md."
)


def foreign_entries(store: Store) -> list[str]:
    """Entries in the checkpoint directory ``store`` that this package did not write
    (``name`` or ``name (kind)``); empty when all of it is ours or it does not exist."""
    if store.is_local and os.path.islink(store.path()):
        return [f"{store.path()} (a symlink)"]
    foreign = []
    for name, kind in store.children():
        if kind == "file" and is_our_file(name):
            continue
        if kind == "dir" and is_generation(name):
            inner = [
                f"{name}/{n}" + ("" if k == "file" else f" ({k})")
                for n, k in store.children(name)
                if not (k == "file" and is_our_file(n))
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
