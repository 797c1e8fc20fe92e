"""What is ours to delete or save over (docs/security.md): the one ownership check.

A directory is ours only when its name is one we give (when chosen by name) and everything in
it is a file we write (:func:`foreign_entries` empty). :func:`check_owned` returns the
:class:`~lightning_preempt.storage.local.Owned` verdict every recursive delete demands.
"""

from __future__ import annotations

import logging
import os

from lightning_preempt.errors import CheckpointExistsError
from lightning_preempt.format.manifest import MAX_MANIFEST_BYTES, declares_our_format
from lightning_preempt.format.names import MANIFEST_NAME, is_generation, is_our_file
from lightning_preempt.storage import local
from lightning_preempt.storage.local import Owned
from lightning_preempt.storage.store import Store, kind_at

log = logging.getLogger(__name__)

_HINT = (
    "lightning_preempt deletes only directories it wrote whose every file is one of its own. Move your "
    "files out of it (or delete the directory yourself), and keep other data out of the checkpoint dirpath. "
    "See docs/security.md."
)
_SAVE_HINT = (
    "lightning_preempt saves only into a new path, an empty directory or a checkpoint it wrote itself, and "
    "never deletes files it did not write. Save to another path (e.g. a name ending in .ckpt), or move your "
    "files out of this directory first. See docs/security.md."
)


def foreign_entries(store: Store) -> list[str]:
    """Entries in the checkpoint directory ``store`` that this package did not write
    (``name`` or ``name (kind)``); empty when all of it is ours or it does not exist."""
    if store.is_local and os.path.islink(store.path()):
        return [f"{store.path()} (a symlink)"]
    foreign = _foreign_in(store, "")
    for name, kind, _ in store.entries():
        if kind == "dir" and is_generation(name):
            foreign.extend(_foreign_in(store, name, nested=False))
    return foreign


def _foreign_in(store: Store, rel: str, *, nested: bool = True) -> list[str]:
    """The foreign entries directly in ``rel`` (generation directories allowed if ``nested``)."""
    foreign = []
    for name, kind, _ in store.entries(rel):
        path = f"{rel}/{name}" if rel else name
        if kind == "file" and is_our_file(name):
            if name == MANIFEST_NAME and not _is_our_manifest(store, path):
                foreign.append(f"{path} (not a lightning_preempt manifest)")
        elif not (nested and kind == "dir" and is_generation(name)):
            foreign.append(path if kind == "file" else f"{path} ({kind})")
    return foreign


def _is_our_manifest(store: Store, name: str) -> bool:
    """A ``manifest.json`` is ours only if it declares our format (a user's is not)."""
    try:
        return declares_our_format(store.read_bytes(name, MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        return True  # deleted meanwhile (by us: manifests are removed first)
    except Exception:  # unreadable, oversized, not a regular file: not provably ours
        return False


def check_owned(store: Store, *, doing: str = "delete") -> Owned:
    """The verdict that lets storage delete or replace ``store`` (all ours, empty or absent);
    else :class:`CheckpointExistsError`. ``doing``: for the message (``"delete"``…)."""
    foreign = foreign_entries(store)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CheckpointExistsError(
            f"refusing to {doing} {store.url}: it holds things lightning_preempt did not write ({shown})",
            path=store.url,
            hint=_HINT if doing == "delete" else _SAVE_HINT,
        )
    return Owned(store.path())


def remove_if_ours(store: Store, *, why: str) -> None:
    """Delete our checkpoint directory ``store``, manifest first (a half-deleted one is never
    committed), and log it; :class:`CheckpointExistsError` when anything in it is foreign."""
    owned = check_owned(store)
    store.rm_file(MANIFEST_NAME)
    store.rm_tree(owned=owned)
    log.info("lightning_preempt: deleted %s (%s)", store.url, why)


def remove_path(store: Store) -> None:
    """Delete what is at ``store``'s path: our checkpoint directory (only if it holds nothing
    foreign), a plain checkpoint file, a symlink (never what it points to). Logs, never raises
    (the saver's deletes run behind training)."""
    try:
        if store.is_local and (os.path.islink(store.path()) or os.path.isfile(store.path())):
            local.remove_local(store.path())  # a link goes, never what it points to
        elif store.stat(MANIFEST_NAME) is not None or kind_at(store) == "dir":
            remove_if_ours(store, why="removal requested")  # manifest first: never half-deleted yet committed
        elif store.stat() is not None:
            store.rm_file("")
        else:
            log.debug("lightning_preempt: nothing to remove at %s", store.url)
            return
        log.debug("lightning_preempt: removed checkpoint %s", store.url)
    except Exception as err:
        log.error(
            "lightning_preempt: could not remove checkpoint %s: %s: %s\nHINT: check permissions and the storage; "
            "delete it by hand if it is no longer needed.",
            store.url, type(err).__name__, err,
        )  # fmt: skip
