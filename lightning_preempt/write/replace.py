"""Where a checkpoint's files live under its path, and replacing a checkpoint there without
tearing it: a fresh generation ``P/v-<12 hex>/`` and one atomic manifest write, a create-only
claim between concurrent saves, a swap on local disk for a plain file (docs/design.md,
"Replacing a checkpoint at its path", "Commit protocol")."""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import uuid
from collections.abc import Iterable
from typing import Literal

from lightning_preempt.catalog.ownership import check_owned
from lightning_preempt.errors import CheckpointError, CheckpointExistsError
from lightning_preempt.format.manifest import DATA_DIR_KEY, MAX_MANIFEST_BYTES, generation_of, parse_manifest
from lightning_preempt.format.names import (
    CLAIM_NAME,
    MANIFEST_NAME,
    MARKER_NAME,
    is_commit_temp,
    is_our_file,
    is_sibling_of,
    new_generation,
    sibling_name,
)
from lightning_preempt.storage import local
from lightning_preempt.storage.store import CHUNK_BYTES, Store, files_below, kind_at

log = logging.getLogger(__name__)


def ensure_exists(store: Store) -> None:
    """Make ``store.url`` exist now, before the background write: Lightning's
    ``ModelCheckpoint`` checks it for ``-v1`` versioning and ``save_last="link"``.

    Local disk: the directory. Object stores have no directories: a zero-byte marker.
    Never raises (rank 0 alone calls it: raising here would leave the other ranks in the save
    job's collectives until the group times out); the write job meets the same failure and
    raises it on every rank (write/commit.py's agreement).
    """
    try:
        if store.stat() is not None:
            return
        store.makedirs()
        if store.stat() is None:
            store.commit_bytes(MARKER_NAME, b"", exclusive=False)
    except Exception as err:
        log.warning("lightning_preempt: could not create %s yet (%s); the save reports it", store.url, err)


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
    replace: bool = False  # the path held a committed checkpoint: the commit replaces its manifest (else create-only)
    replaced: str | None = None  # the generation holding the replaced checkpoint's files (None: beside it)

    def data(self, root: Store) -> Store:
        """Where the files (and, except for generations, the manifest) are written."""
        if self.mode == "generation":
            return root.child(self.name)
        if self.mode == "beside":
            return root.parent().child(self.name)
        return root

    def commit_store(self, root: Store) -> Store:
        """Where ``manifest.json`` is written."""
        return self.data(root) if self.mode == "beside" else root

    @property
    def manifest_extra(self) -> dict[str, str]:
        return {DATA_DIR_KEY: self.name} if self.mode == "generation" else {}


def plan_write(root: Store) -> WritePlan:
    """Rank 0, before a save writes anything: decide the :class:`WritePlan` and clear this
    package's uncommitted leftovers at the path (never files it did not write).

    Raises :class:`CheckpointExistsError` (HINT, nothing touched) when the path is a
    directory holding anything this package did not write (a user's ``src/``, their own
    ``manifest.json``): a save never writes into, or deletes, someone else's directory.
    """
    if root.stat(MANIFEST_NAME) is not None:
        check_owned(root, doing="save into")
        return WritePlan("generation", new_generation(), replace=True, replaced=live_generation(root))
    a_file = kind_at(root) not in (None, "dir")
    if a_file and not root.is_object_store:
        return WritePlan("beside", sibling_name(_base(root), "new"))
    check_owned(root, doing="save into")  # (an object store: the file object and our objects under P/ coexist)
    return _claim(root, remove_file=a_file)


def _claim(root: Store, *, remove_file: bool) -> WritePlan:
    """Nothing is committed at ``root``: write in place if this save is the first to claim
    it (create-only), else into a generation of its own (another save is writing in place
    now, or one was killed doing so; the create-only manifest decides between them)."""
    root.makedirs()
    try:
        # Not synced: the claim only settles who writes in place among the saves running
        # now; after a crash a lost claim and a stale one both mean "nobody is writing here".
        root.commit_bytes(CLAIM_NAME, uuid.uuid4().hex.encode(), exclusive=True, durable=False)
    except CheckpointExistsError:
        return WritePlan("generation", new_generation(), remove_file=remove_file)
    if root.stat(MANIFEST_NAME) is not None:
        # Another save committed (and released its claim) since we looked: replace it. Its
        # commit came before its release, so a claim won after the release sees its manifest.
        root.rm_file(CLAIM_NAME, durable=False)
        return WritePlan("generation", new_generation(), replace=True, replaced=live_generation(root))
    _remove_ours(root, CLAIM_NAME)  # an earlier save's partial files (never the claim: it is ours now)
    return WritePlan("in_place", remove_file=remove_file)


def finish_write(root: Store, plan: WritePlan) -> None:
    """Rank 0, after the commit: make the new checkpoint the only one at the path.

    For ``"beside"`` a failure raises (the path still holds the old checkpoint); otherwise
    the new checkpoint is already live and a failed clean-up is only logged.
    """
    if plan.mode == "beside":
        swap_in(root, plan.name)
    try:
        if plan.remove_file:
            root.rm_file()  # P/manifest.json exists now: it wins over the file
        if plan.mode == "in_place":
            root.rm_file(CLAIM_NAME, durable=False)  # a claim back after a crash is only stale
        elif plan.mode == "generation" and live_generation(root) == plan.name:
            # (another writer may have replaced this checkpoint since: its files are not stale)
            _remove_ours(root, plan.name, plan.replaced)
        if not root.is_object_store:
            remove_stale_siblings(root)
    except Exception as err:  # the new checkpoint is committed; leftovers go next time
        log.warning("lightning_preempt: could not delete the replaced checkpoint's files at %s: %s", root.url, err)


def _remove_ours(root: Store, skip: str, replaced: str | None = None) -> None:
    """Delete the files of ours directly in ``root`` (a killed or losing save's partial files,
    the replaced checkpoint's), except the manifest, the marker, ``skip`` and commits in
    flight, and the generation ``replaced`` (the one the replaced manifest named). Never any
    other generation: it may be a concurrent save's, still being written, that a delete would
    tear once it commits (a killed save's stays, unreferenced, until the path is deleted)."""
    for entry in root.entries():
        name = entry.name
        if name in (MANIFEST_NAME, MARKER_NAME, skip) or is_commit_temp(name):
            continue  # (a concurrent save's commit in flight: its writer deletes the temporary file)
        if entry.kind == "dir" and name == replaced:
            _delete(root, name, is_dir=True)
        elif entry.kind == "file" and is_our_file(name):  # (a symlink: never here)
            root.rm_file(name)


def live_generation(root: Store) -> str | None:
    """The generation the manifest at ``root`` names; ``None``: its files are beside it, or the
    manifest cannot be read (a damaged checkpoint's files stay)."""
    try:
        manifest = parse_manifest(root.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES), path=root.url)
        return generation_of(manifest, path=root.url)
    except (CheckpointError, OSError):
        return None


def abandon(root: Store, plan: WritePlan, names: Iterable[str]) -> None:
    """Rank 0, after another writer's manifest won the create-only commit: delete what this
    save wrote (``names``, its files), never what the committed checkpoint uses."""
    if plan.mode != "in_place":  # its own generation, or its directory beside the path
        _delete(plan.data(root).parent(), plan.name, is_dir=True)
    elif live_generation(root) is not None:  # the winner's files are in its generation
        for name in names:
            root.rm_file(name)


def remove_stale_siblings(root: Store) -> None:
    """File systems: delete ``.NAME.lp-new-…``/``.NAME.lp-old-…`` left beside the path by
    a change of kind that a crash interrupted (the path itself is complete now)."""
    parent, base = root.parent(), _base(root)
    for entry in parent.entries():
        if is_sibling_of(entry.name, base) and entry.kind in ("file", "dir"):
            _delete(parent, entry.name, is_dir=entry.kind == "dir")


def _base(store: Store) -> str:
    return posixpath.basename(store.url.rstrip("/"))


def swap_in(root: Store, new_name: str) -> None:
    """Put the entry ``new_name`` beside ``root`` (in the same parent) at ``root``'s path,
    whatever kind of entry each is (never on object stores: no renames there).

    The old entry moves aside, the new one moves in, then the old one is deleted. At every
    moment a complete checkpoint exists, at the path or beside it.
    """
    parent, base = root.parent(), _base(root)
    aside = sibling_name(base, "old")
    if root.is_local:  # two atomic renames
        owned = check_owned(root, doing="replace") if _is_real_dir(parent, base) else None
        local.replace_entry(root.path(), parent.path(new_name), parent.path(aside), first=MANIFEST_NAME, owned=owned)
        return
    had_old = parent.stat(base) is not None
    if had_old:
        _move(parent, base, aside)
    _move(parent, new_name, base)
    if had_old:
        _delete(parent, aside, is_dir=kind_at(parent, aside) == "dir")


def _move(store: Store, src: str, dst: str) -> None:
    """A move on a file system without atomic renames (``memory://``; fsspec's ``mv`` is
    copy, then delete): the copy gets its manifest last, the source loses its manifest
    first, so neither is ever a committed but incomplete checkpoint."""
    if kind_at(store, src) != "dir":
        _copy_file(store, src, dst)
        store.rm_file(src)
        return
    for rel in sorted(files_below(store, src), key=lambda r: posixpath.basename(r) == MANIFEST_NAME):
        _copy_file(store, f"{src}/{rel}", f"{dst}/{rel}")
    _delete(store, src, is_dir=True)


def _copy_file(store: Store, src: str, dst: str) -> None:
    with store.open_read(src) as reader, store.open_write(dst) as writer:
        while chunk := reader.read(CHUNK_BYTES):
            writer.write(chunk)


def _delete(store: Store, name: str, *, is_dir: bool) -> None:
    if is_dir:
        owned = check_owned(store.child(name))  # before anything goes, the manifest included
        store.rm_file(f"{name}/{MANIFEST_NAME}")  # uncommit first
        store.rm_tree(name, owned=owned)
    else:
        store.rm_file(name)


def write_file_atomic(store: Store, data: bytes) -> None:
    """Put a plain file holding ``data`` at ``store.url``; readers see the old entry or the
    new file, never a partial one (local: temp + fsync + rename; object stores: one PUT)."""
    parent, base = store.parent(), _base(store)
    if store.is_object_store:
        committed = store.stat(MANIFEST_NAME) is not None
        if committed:
            check_owned(store, doing="replace")  # the objects under P/ are deleted below
        store.commit_bytes("", data, exclusive=False)
        if committed:
            # An object store holds the new file and the old directory side by side: uncommit
            # the directory (loading then takes the file), then delete its objects one by one
            # (a recursive delete of the prefix would take the file with it).
            store.rm_file(MANIFEST_NAME)
            for rel in files_below(store):
                store.rm_file(rel)
        return
    tmp = sibling_name(base, "new")
    parent.makedirs()
    if not _is_real_dir(parent, base):
        if store.is_local:
            local.write_atomic(store.path(), data, tmp_name=tmp)
        else:
            store.commit_bytes("", data, exclusive=False)
    else:  # a checkpoint directory is at the path: write beside it, then swap
        check_owned(store, doing="replace")  # a user's directory is refused before anything is written
        try:
            with parent.open_write(tmp) as f:  # durable on close; nobody reads this name
                f.write(data)
            swap_in(store, tmp)
        except BaseException:
            parent.rm_file(tmp)
            raise
    try:
        remove_stale_siblings(store)
    except Exception as err:  # the new file is in place; leftovers go next time
        log.warning("lightning_preempt: could not delete leftovers beside %s: %s", store.url, err)


def _is_real_dir(parent: Store, name: str) -> bool:
    """A directory, not a symlink to one, is at ``name`` (a symlink is replaced as a file)."""
    return any(e.name == name and e.kind == "dir" for e in parent.entries())
