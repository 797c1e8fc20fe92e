"""Where a checkpoint's files live under its path, and replacing a checkpoint there.

A checkpoint at ``P`` is committed when ``P/manifest.json`` exists. The first save to
``P`` writes its files directly into ``P``. Lightning also saves *over* paths by design
(``last.ckpt``, a fixed filename, a re-run into the same folder); the checkpoint there
must never be torn, and object stores cannot rename a directory. So a save to a path
that already holds a committed checkpoint adds one level of indirection:

1. the new files go to a fresh *generation* directory ``P/v-<12 hex>/``;
2. the commit replaces ``P/manifest.json`` with one atomic write (local disk: temp file,
   fsync, ``os.replace``; object stores: one PUT). The new manifest names its generation
   in ``extra["data_dir"]``; file names in it stay plain names;
3. only then are the old checkpoint's files (in ``P`` itself or an older generation)
   deleted.

A crash before 2 leaves the old checkpoint (plus an unreferenced generation the next
save to ``P`` deletes); a crash after 2 leaves the new one (plus stale files). Readers
find a manifest's files with :func:`data_store`; nothing else about reading changes.

A plain Lightning file at ``P`` (``TorchCheckpointIO``, or our saves outside ``fit``) is
replaced the same way where the store allows both a file and a directory at ``P``
(object stores: the file is deleted after the commit); elsewhere (local disk,
``memory://``) the new checkpoint is committed beside ``P`` and swapped in with two
renames (:func:`swap_in`), so the old one exists until the new one does.

Only names this package writes are ever deleted here (``format/names.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import posixpath
from typing import Literal

from lightning_preempt.format.layout import DATA_DIR_KEY
from lightning_preempt.format.names import (
    MANIFEST_NAME,
    MARKER_NAME,
    is_generation,
    is_our_file,
    is_sibling_of,
    new_generation,
    sibling_name,
)
from lightning_preempt.storage.store import Store, fsync_dir

log = logging.getLogger(__name__)

_OBJECT_STORES = frozenset({"gs", "gcs", "s3", "s3a"})


def file_and_dir_coexist(store: Store) -> bool:
    """Object stores can hold an object ``P`` and objects under ``P/`` at once; file systems cannot."""
    return not store.is_local and store.protocol in _OBJECT_STORES


# ---- the path exists as soon as a save is accepted ------------------------------------
def ensure_exists(store: Store) -> None:
    """Make ``store.url`` exist now, before the background write: Lightning's
    ``ModelCheckpoint`` checks it for ``-v1`` versioning and ``save_last="link"``.

    Local disk: the directory. Object stores have no directories: a zero-byte marker.
    """
    if store.exists():
        return
    store.makedirs()
    if not store.exists():
        store.commit_bytes(MARKER_NAME, b"", exclusive=False)


# ---- what a save does at its path ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WritePlan:
    """Where one save writes (decided by rank 0, the same on every rank).

    ``mode``: ``"in_place"`` (nothing committed at the path), ``"generation"`` (replace a
    committed checkpoint through ``P/<name>/``) or ``"beside"`` (local disk, a plain file at
    the path: commit in the sibling directory ``<name>``, then swap it in).
    """

    mode: Literal["in_place", "generation", "beside"]
    name: str = ""
    remove_file: bool = False  # object stores: a plain file object at the path, deleted after commit

    def data(self, root: Store) -> Store:
        """Where the files (and, except for generations, the manifest) are written."""
        if self.mode == "generation":
            return root.child(self.name)
        if self.mode == "beside":
            return Store(join_sibling(root.url, self.name), root.storage_options)
        return root

    def commit_store(self, root: Store) -> Store:
        """Where ``manifest.json`` is written."""
        return self.data(root) if self.mode == "beside" else root

    @property
    def manifest_extra(self) -> dict[str, str]:
        return {DATA_DIR_KEY: self.name} if self.mode == "generation" else {}

    @property
    def exclusive(self) -> bool:
        """Create-only commit, except when replacing a committed manifest on purpose."""
        return self.mode != "generation"


def plan_write(root: Store) -> WritePlan:
    """Rank 0, before a save writes anything: decide the :class:`WritePlan` and clear this
    package's uncommitted leftovers at the path (never files it did not write)."""
    if root.exists(MANIFEST_NAME):
        return WritePlan("generation", new_generation())
    if root.exists() and not root.isdir():
        if file_and_dir_coexist(root):
            remove_stale(root, live=None)  # partial objects of an earlier save under P/
            return WritePlan("in_place", remove_file=True)
        return WritePlan("beside", sibling_name(posixpath.basename(root.url.rstrip("/")), "new"))
    remove_stale(root, live=None)  # an earlier save's partial files
    return WritePlan("in_place")


def finish_write(root: Store, plan: WritePlan) -> None:
    """Rank 0, after the commit: make the new checkpoint the only one at the path.

    For ``"beside"`` a failure raises (the path still holds the old checkpoint); otherwise
    the new checkpoint is already live and a failed clean-up is only logged.
    """
    if plan.mode == "beside":
        swap_in(root, plan.data(root).path())
    try:
        if plan.remove_file:
            root.fs.rm_file(root.path())  # P/manifest.json exists now: it wins over the file
            root.invalidate_cache()
        elif plan.mode == "generation":
            remove_stale(root, live=plan.name)
        if not file_and_dir_coexist(root):
            remove_stale_siblings(root)
    except Exception as err:  # the new checkpoint is committed; leftovers go next time
        log.warning("lightning_preempt: could not delete the replaced checkpoint's files at %s: %s", root.url, err)


def remove_stale(root: Store, *, live: str | None) -> list[str]:
    """Delete this package's entries directly under ``root`` except the manifest, the
    marker and the ``live`` generation (``None``: the files are being written in place)."""
    removed = []
    for name, is_dir in _entries(root):
        if name in (MANIFEST_NAME, MARKER_NAME, live) or not (is_generation(name) if is_dir else is_our_file(name)):
            continue
        if is_dir:
            root.rm_tree(name)
        else:
            root.rm_file(name)
        removed.append(name)
    return removed


def remove_stale_siblings(root: Store) -> list[str]:
    """File systems: delete ``.NAME.lp-new-…``/``.NAME.lp-old-…`` left beside the path by
    a change of kind that a crash interrupted (the path itself is complete now)."""
    parent = Store(posixpath.dirname(root.url.rstrip("/")), root.storage_options)
    base = posixpath.basename(root.url.rstrip("/"))
    removed = []
    for name, is_dir in _entries(parent):
        if is_sibling_of(name, base):
            if is_dir:
                parent.rm_tree(name)
            else:
                parent.rm_file(name)
            removed.append(name)
    return removed


def _quietly_remove_stale_siblings(store: Store) -> None:
    try:
        remove_stale_siblings(store)
    except Exception as err:  # the new file is in place; leftovers go next time
        log.warning("lightning_preempt: could not delete leftovers beside %s: %s", store.url, err)


def _entries(root: Store) -> list[tuple[str, bool]]:
    root.invalidate_cache()
    base = root.path().rstrip("/")
    try:
        listing = root.fs.ls(base, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for entry in listing:
        full = str(entry["name"]).rstrip("/")
        name = posixpath.basename(full)
        if not name or full == base:
            continue
        out.append((name, entry.get("type") == "directory"))
    return out


# ---- file systems: a plain file and a directory cannot share a path ------------------
def join_sibling(url: str, name: str) -> str:
    return posixpath.join(posixpath.dirname(str(url).rstrip("/")), name)


def swap_in(root: Store, new_path: str) -> None:
    """Put the entry at ``new_path`` (same file system) at ``root``'s path, whatever kind
    of entry each is (never on object stores: no renames there).

    Two renames: the old entry moves aside, the new one moves in, then the old one is
    deleted. At every moment a complete checkpoint exists, at the path or beside it.
    """
    path = root.path()
    old = posixpath.join(posixpath.dirname(path), sibling_name(posixpath.basename(path.rstrip("/")), "old"))
    if root.is_local:
        had_old = os.path.lexists(path)
        if had_old:
            os.rename(path, old)
        os.rename(new_path, path)
        fsync_dir(os.path.dirname(path))
        if had_old:
            remove_local(old)
        return
    root.invalidate_cache()
    had_old = bool(root.fs.exists(path))
    if had_old:
        _move(root, path, old)
    _move(root, new_path, path)
    if had_old:
        _delete(root, old)
    root.invalidate_cache()


def _move(root: Store, src: str, dst: str) -> None:
    """A move on a file system without atomic directory renames (fsspec's ``mv`` is copy,
    then delete): the copy gets its manifest last, the source loses its manifest first,
    so neither is ever a committed but incomplete checkpoint."""
    fs = root.fs
    if not fs.isdir(src):
        fs.mv(src, dst)
        return
    files = sorted(fs.find(src), key=lambda p: posixpath.basename(p) == MANIFEST_NAME)
    for file in files:
        fs.makedirs(posixpath.dirname(posixpath.join(dst, posixpath.relpath(file, src))), exist_ok=True)
        fs.cp_file(file, posixpath.join(dst, posixpath.relpath(file, src)))
    _delete(root, src)


def _delete(root: Store, path: str) -> None:
    fs = root.fs
    if fs.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(posixpath.join(path, MANIFEST_NAME))  # uncommit first
        fs.rm(path, recursive=True)
    else:
        fs.rm_file(path)


def remove_local(path: str) -> None:
    """Delete a local file, symlink (only the link) or directory tree."""
    import shutil

    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, MANIFEST_NAME))  # uncommit first: never half-deleted yet committed
        shutil.rmtree(path)
    fsync_dir(os.path.dirname(path))


def write_file_atomic(store: Store, data: bytes) -> None:
    """Put a plain file holding ``data`` at ``store.url``; readers see the old entry or the
    new file, never a partial one (local: temp + fsync + rename; object stores: one PUT)."""
    if store.is_local:
        path = store.path()
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, sibling_name(os.path.basename(path), "new"))
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if os.path.isdir(path) and not os.path.islink(path):
                swap_in(store, tmp)
            else:
                os.replace(tmp, path)
                fsync_dir(parent)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _quietly_remove_stale_siblings(store)
        return
    if not file_and_dir_coexist(store) and store.isdir():
        tmp = join_sibling(store.path(), sibling_name(posixpath.basename(store.path().rstrip("/")), "new"))
        store.fs.pipe_file(tmp, data)
        swap_in(store, tmp)
        _quietly_remove_stale_siblings(store)
        return
    store.fs.pipe_file(store.path(), data)
    store.invalidate_cache()
    if store.exists(MANIFEST_NAME):
        # An object store holds the new file and the old directory side by side: uncommit
        # the directory (loading then takes the file), then delete its objects one by one
        # (a recursive delete of the prefix would take the file with it).
        store.rm_file(MANIFEST_NAME)
        for rel in store.list_files():
            if rel not in (".", ""):
                store.rm_file(rel)

