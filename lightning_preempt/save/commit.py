"""Writing one checkpoint directory, ending with the commit.

Protocol (every rank, in the writer thread, on the writer's own gloo group):

0. rank 0 decides where the files go (:func:`lightning_preempt.layout.plan_write`): into
   the path, or into a new generation directory when the path already holds a committed
   checkpoint (replacement, see ``layout.py``); every rank follows its decision;
1. every rank creates the directory; ranks agree it worked before any DCP collective;
2. ``dcp.save`` writes each rank's share of the tensors (DCP gathers per-rank failures
   and raises on every rank);
3. every rank writes its own ``state-rankNNNNN.pt`` (the non-tensor skeleton);
4. all ranks exchange their file entries or error; if any rank failed, no rank commits
   and every rank raises the same :class:`CheckpointWriteError`;
5. rank 0 writes ``manifest.json`` atomically — commit metadata only after all ranks
   completed writing — and tells the others whether the commit itself succeeded;
6. rank 0 deletes what the new checkpoint replaced (:func:`lightning_preempt.layout.finish_write`).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointWriteError
from lightning_preempt.format.manifest import FileEntry, Manifest
from lightning_preempt.format.names import MANIFEST_NAME, state_file
from lightning_preempt.save.dcp_writer import ChecksummingWriter
from lightning_preempt.save.layout import finish_write, plan_write
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import Store

_STORAGE_HINT = (
    "Check that the storage is reachable, writable and has space; earlier committed checkpoints are "
    "untouched and training can resume from them."
)
#: a storage error on rank 0 becomes the same CheckpointWriteError on every rank
_FAILED: dict[str, Any] = {"foreign": CheckpointWriteError, "hint": _STORAGE_HINT}

# dcp.save(no_dist=True) still warns that it assumes a single process: that is our intent.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


@dataclasses.dataclass
class SaveRequest:
    """Everything the writer needs; tensors are staged host copies owned by the stager."""

    url: str
    tensors: dict[str, torch.Tensor]
    skeleton: bytes
    step: int
    epoch: int
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Written to the manifest when set: retention given a run id spares other runs' checkpoints.
    run_id: str | None = None


def write_checkpoint(
    request: SaveRequest,
    *,
    group: pdist.ProcessGroup | None = None,
    thread_count: int = 1,
) -> Manifest:
    """Write and commit ``request``; returns the committed manifest (on every rank).

    With ``group`` every rank of it must call this for the same checkpoint.
    """
    root = Store(request.url, request.storage_options)
    rank, world = pdist.rank(group) if group else 0, pdist.world_size(group) if group else 1
    started = time.perf_counter()

    plan = agree.decide(lambda: plan_write(root), group, what="preparing the checkpoint path", **_FAILED)
    store = plan.data(root)
    _agree_or_raise(_attempt(store.makedirs), group, root, "creating the checkpoint directory")

    entries: dict[str, FileEntry] = {}

    def write_files() -> None:
        writer = ChecksummingWriter(store, thread_count=thread_count)
        try:
            dcp.save(request.tensors, storage_writer=writer, process_group=group, no_dist=group is None)
        except CheckpointException as err:  # BaseException in DCP: convert, keep the cause
            mine = writer.storage_error
            what = f"{type(mine).__name__}: {mine}" if mine is not None else f"DCP reports {_dcp_failures(err)}"
            raise CheckpointWriteError(
                f"writing the shards failed: {what}", path=root.url, hint=_hint_of(mine, err)
            ) from err
        entries.update(writer.entries)
        name = state_file(rank)
        entries[name] = _write_hashed(store, name, request.skeleton)

    outcome = _attempt(write_files)
    results = pdist.all_gather_objects((entries, outcome), group)
    _agree_or_raise([r[1] for r in results], None, root, "writing checkpoint files")

    manifest = Manifest(
        step=request.step,
        epoch=request.epoch,
        world_size=world,
        files={name: entry for rank_entries, _ in results for name, entry in rank_entries.items()},
        tensor_bytes=sum(t.numel() * t.element_size() for t in request.tensors.values()),
        stats={**request.stats, "write_s": time.perf_counter() - started},
        extra={**request.extra, **plan.manifest_extra},
        run_id=request.run_id,
    )
    # Commit metadata only after all ranks completed writing (the gather above). Rank 0
    # commits; every rank gets its outcome. A CheckpointExistsError (the create-only commit
    # found another writer's manifest: theirs stands) is raised as such on every rank.
    target = plan.commit_store(root)

    def commit() -> None:
        target.commit_bytes(MANIFEST_NAME, manifest.to_json(), exclusive=plan.exclusive)
        if plan.mode == "beside":  # committed beside the path; it is saved once it is *at* it
            finish_write(root, plan)

    agree.decide(commit, group, what="committing the manifest", **_FAILED)
    if rank == 0 and plan.mode != "beside":
        finish_write(root, plan)  # only deletes what was replaced; logs its own failures
    return manifest


def _dcp_failures(err: CheckpointException) -> str:
    """One line per failed rank instead of DCP's full tracebacks."""
    parts = []
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return "; ".join(parts)


def _write_hashed(store: Store, name: str, data: bytes) -> FileEntry:
    crc = Crc32c()
    crc.update(data)
    with store.open_write(name) as f:
        f.write(data)
    return FileEntry(len(data), crc.hexdigest())


def _attempt(fn: Any) -> str | None:
    """Run ``fn``; return ``None`` or a picklable description of what went wrong."""
    try:
        fn()
        return None
    except (Exception, CheckpointException) as err:
        return "".join(traceback.format_exception_only(type(err), err)).strip()


def _agree_or_raise(
    outcome: str | list[str | None] | None, group: pdist.ProcessGroup | None, store: Store, what: str
) -> None:
    outcomes = outcome if isinstance(outcome, list) else pdist.all_gather_objects(outcome, group)
    failures = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if failures:
        detail = "; ".join(f"rank {r}: {e.splitlines()[0]}" for r, e in failures)
        # an error of ours already says what to do (e.g. "the bucket does not exist")
        hints = [e.split("\nHINT: ", 1)[1].strip() for _, e in failures if "\nHINT: " in e]
        raise CheckpointWriteError(
            f"{what} failed, nothing was committed ({detail})",
            path=store.url,
            hint=hints[0] if hints else _STORAGE_HINT,
        )


def _hint_of(mine: BaseException | None, err: CheckpointException) -> str | None:
    """The HINT of the first error of ours among a failed ``dcp.save``'s causes."""
    failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
    for exc in [mine, *failures]:
        hint = getattr(exc, "hint", None)
        if isinstance(hint, str):
            return hint
    return None
