"""Finding checkpoints. Only a committed one (a readable manifest) counts, for resume and
retention alike: a partial directory can never push out the last good checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from lightning_preempt.errors import CheckpointError, CorruptCheckpointError, UnsupportedFormatError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import MANIFEST_NAME, dir_step, foreign_step
from lightning_preempt.read.verify import read_manifest
from lightning_preempt.storage.store import Store


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory under a root URL."""

    path: str
    name: str
    step: int
    committed: bool
    epoch: int | None = None
    created_unix: float | None = None
    size_bytes: int | None = None
    world_size: int | None = None
    manifest: Manifest | None = dataclasses.field(default=None, repr=False, compare=False)
    problem: str | None = None
    newer_format: bool = False

    @classmethod
    def committed_one(cls, path: str, name: str, m: Manifest) -> CheckpointInfo:
        """The committed checkpoint at ``path`` whose manifest is ``m``."""
        return cls(path, name, m.step, True, m.epoch, m.created_unix, m.total_bytes, m.world_size, m)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("manifest")
        return d


def list_checkpoints(url: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Every checkpoint directory directly under ``url``, newest first: named as ours, or
    holding our manifest (``epoch=0-step=100.ckpt/``). ``committed``: the manifest parses and
    names the step its directory carries."""
    root = Store(url, storage_options)
    dirs = [e.name for e in root.entries() if e.kind == "dir"]
    found = [info for name in dirs if (info := _describe(root, name)) is not None]
    found.sort(key=lambda c: (c.step, c.committed, c.created_unix or 0.0, c.name), reverse=True)
    return found


def _describe(root: Store, name: str) -> CheckpointInfo | None:
    store = root.child(name)
    ours = dir_step(name) is not None
    name_step = dir_step(name) if ours else foreign_step(name)
    if store.stat(MANIFEST_NAME) is None:
        if not ours or name_step is None:
            return None  # someone else's directory: not listed, never touched
        return CheckpointInfo(store.url, name, name_step, committed=False, problem="no manifest (partial save)")
    try:
        m = read_manifest(store)
        if name_step is not None and m.step != name_step:
            # Believing it would let one planted manifest outrank (and prune) real checkpoints.
            raise CorruptCheckpointError(
                f"the manifest says step {m.step} but the directory is named for step {name_step}",
                path=store.url,
                hint="The checkpoint was renamed, copied under another name or tampered with; it is not used.",
            )
    except CheckpointError as err:
        if not ours and str(err).startswith(("manifest does not declare format", "manifest is not valid JSON")):
            return None  # a manifest.json of some other tool
        step = name_step if name_step is not None else -1
        return CheckpointInfo(store.url, name, step, committed=False, problem=str(err).splitlines()[0],
                              newer_format=isinstance(err, UnsupportedFormatError))  # fmt: skip
    return CheckpointInfo.committed_one(store.url, name, m)


def complete_local_checkpoints(local_root: str) -> list[CheckpointInfo]:
    """Committed checkpoints under ``local_root`` whose files are all present with their sizes
    (cheap: no checksums). On a multi-host job rank 0's disk holds only its host's shares:
    those do not count."""
    out = []
    for info in list_checkpoints(local_root, {}):
        if not info.committed or info.manifest is None:
            continue
        try:
            if all(os.path.getsize(os.path.join(info.path, n)) == e.size for n, e in info.manifest.files.items()):
                out.append(info)
        except (FileNotFoundError, NotADirectoryError):
            continue  # any other error is "could not tell" and raised: never "incomplete" on an EIO
    return out

