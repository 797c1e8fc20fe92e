"""Which checkpoint a URL names (itself, or one STEP of those under it), and turning storage
failures into errors whose HINT says what to set. Needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from lightning_preempt.catalog.listing import CheckpointInfo, list_checkpoints
from lightning_preempt.cli.options import PROG, UsageError
from lightning_preempt.cli.output import print_note
from lightning_preempt.errors import CheckpointError, NotACheckpointError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import MANIFEST_NAME, is_checkpoint_file
from lightning_preempt.read.verify import read_manifest
from lightning_preempt.storage.diagnose import storage_hint
from lightning_preempt.storage.store import Store, files_below

T = TypeVar("T")


class StorageAccessError(CheckpointError):
    """The storage could not be reached or refused us (exit code 1)."""


def storage_call(url: str, fn: Callable[[], T]) -> T:
    """Run ``fn``; turn storage-layer failures (credentials, network, missing driver) into
    a :class:`StorageAccessError` whose HINT says what to set."""
    try:
        return fn()
    except CheckpointError:
        raise
    except FileNotFoundError as err:
        raise NotACheckpointError(
            f"not found ({err})", path=url, hint=f"Check the path; `{PROG} ls PARENT` lists checkpoints."
        ) from err
    except Exception as err:
        raise StorageAccessError(
            f"cannot access the storage: {type(err).__name__}: {err}", path=url, hint=storage_hint(url, err)
        ) from err


def nothing_here(url: str, options: dict[str, Any]) -> NotACheckpointError:
    """The error for a URL that holds no checkpoint (says whether it exists at all)."""
    try:
        exists = Store(url, options).stat() is not None
    except Exception:
        exists = True
    what = "has no checkpoints" if exists else "does not exist"
    return NotACheckpointError(
        f"{url} {what}",
        path=url,
        hint="Pass PreemptionCallback's dirpath (it holds step-NNNNNNNNNN/ directories) or one checkpoint "
        "directory (it holds manifest.json).",
    )


def list_or_self(url: str, options: dict[str, Any]) -> list[CheckpointInfo]:
    """The checkpoints under ``url``, or ``url`` itself when it is one checkpoint."""
    store = Store(url, options)
    if store.stat(MANIFEST_NAME) is None:
        return list_checkpoints(url, options)
    name = store.url.rstrip("/").rsplit("/", 1)[-1]
    try:
        m = read_manifest(store)
    except CheckpointError as err:
        return [CheckpointInfo(store.url, name, -1, committed=False, problem=str(err).splitlines()[0])]
    return [CheckpointInfo.committed_one(store.url, name, m)]


def resolve_checkpoint(url: str, step: int | None, options: dict[str, Any]) -> tuple[Store, Manifest]:
    """The checkpoint ``url`` names: itself when it holds a manifest, else its ``step``
    (default: the newest committed) among the checkpoints under it."""
    store = Store(url, options)
    if store.stat(MANIFEST_NAME) is not None:
        manifest = read_manifest(store)
        if step is not None and step != manifest.step:
            raise UsageError(
                f"this checkpoint is step {manifest.step}, not {step}",
                path=store.url,
                hint="Pass the parent directory to choose by STEP, or omit STEP.",
            )
        return store, manifest
    infos = list_checkpoints(url, options)
    if not infos:
        if any(is_checkpoint_file(f) for f in files_below(store)):
            read_manifest(store)  # a checkpoint's files without its manifest: says "partial save"
        raise nothing_here(url, options)
    chosen = _newest_committed(infos, url) if step is None else _of_step(infos, step, url, options)
    assert chosen.manifest is not None
    return Store(chosen.path, options), chosen.manifest


def _newest_committed(infos: list[CheckpointInfo], url: str) -> CheckpointInfo:
    committed = [c for c in infos if c.committed]
    if not committed:
        raise NotACheckpointError(
            f"none of the {len(infos)} checkpoint directories is committed "
            f"({'; '.join(f'{c.name}: {c.problem}' for c in infos[:3])})",
            path=url,
            hint="They are partial saves or have a broken manifest; nothing here can be resumed from.",
        )
    for c in infos:
        if not c.committed and c.step > committed[0].step:
            print_note(f"note: skipping newer {c.name}: {c.problem}")
    return committed[0]


def _of_step(infos: list[CheckpointInfo], step: int, url: str, options: dict[str, Any]) -> CheckpointInfo:
    matches = [c for c in infos if c.step == step]
    if not matches:
        steps = ", ".join(str(c.step) for c in infos if c.committed) or "none"
        raise UsageError(
            f"no checkpoint of step {step}",
            path=url,
            hint=f"Committed steps here: {steps}. Run `{PROG} ls {url}` to see them all.",
        )
    good = [c for c in matches if c.committed]
    if good:
        return good[0]
    broken = Store(matches[0].path, options)
    if broken.stat(MANIFEST_NAME) is not None:
        read_manifest(broken)  # raises the precise error (corrupt / newer version)
    raise NotACheckpointError(
        f"checkpoint of step {step} is not committed: manifest.json is missing",
        path=matches[0].path,
        hint="It is a partial save (interrupted before its manifest was written); pick an older STEP.",
    )
