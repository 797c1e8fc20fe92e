"""Writing one checkpoint directory, ending with the commit (docs/design.md "Commit protocol")."""

from __future__ import annotations

import dataclasses
import logging
import operator
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointError, CheckpointExistsError, CheckpointWriteError
from lightning_preempt.format.dcp_compat import dcp_save_tensors
from lightning_preempt.format.manifest import FileEntry, Manifest
from lightning_preempt.format.names import MANIFEST_NAME, state_file
from lightning_preempt.format.structure import Structure
from lightning_preempt.staging.budget import Streamed
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import Store
from lightning_preempt.write.dcp_writer import ChecksummingWriter
from lightning_preempt.write.planning import CachingSavePlanner, PlanCache
from lightning_preempt.write.replace import WritePlan, abandon, finish_write, plan_write

_STORAGE_HINT = (
    "Check that the storage is reachable, writable and has space; earlier committed checkpoints are "
    "untouched and training can resume from them."
)
#: a storage error on rank 0 becomes the same CheckpointWriteError on every rank
_FAILED: dict[str, Any] = {"foreign": CheckpointWriteError, "hint": _STORAGE_HINT}

T = TypeVar("T")
log = logging.getLogger(__name__)


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
    #: Written to the manifest when set: retention given a run id spares other runs' checkpoints.
    run_id: str | None = None
    #: Tensors of ``tensors`` that are the training state's own, not staged copies (over the
    #: host-memory budget, ``staging/budget.py``): written first, then the training resumes.
    streamed: Streamed | None = None
    #: Set once this rank's tensors are written (the commit may go on): their buffers are free.
    written: threading.Event | None = None
    #: The save's structure key (format/structure.py): DCP's local plan is reused while it holds.
    structure: Structure | None = None


def write_checkpoint(
    request: SaveRequest,
    *,
    group: pdist.ProcessGroup | None = None,
    thread_count: int = 1,
    plan_cache: PlanCache | None = None,
) -> Manifest:
    """Write and commit ``request``; returns the committed manifest (on every rank).

    With ``group`` every rank of it must call this for the same checkpoint.
    ``plan_cache``: DCP plans of the previous save to reuse while ``request.structure`` is
    the same (:mod:`lightning_preempt.write.planning`); without one this save plans afresh.
    """
    cache = plan_cache if plan_cache is not None else PlanCache()
    root = Store(request.url, request.storage_options)
    rank = pdist.rank(group) if group else 0
    started = time.perf_counter()
    plan = prepare_path(root, group)
    store = plan.data(root)
    # before the buffers are free; one C-level pass (a DTensor's nbytes: the whole tensor's)
    tensor_bytes = sum(map(_NBYTES, request.tensors.values()))

    def write_files() -> dict[str, FileEntry]:
        writer = ChecksummingWriter(store, thread_count=thread_count, streamed=request.streamed, plan_cache=cache)
        try:
            dcp_save_tensors(
                request.tensors,
                storage_writer=writer,
                planner=CachingSavePlanner(cache, request.structure, collective=group is not None),
                process_group=group,
                no_dist=group is None,
            )
        except CheckpointException as err:  # BaseException in DCP: convert, keep the cause
            mine = writer.storage_error
            what = f"{type(mine).__name__}: {mine}" if mine is not None else f"DCP reports {_dcp_failures(err)}"
            raise CheckpointWriteError(
                f"writing the shards failed: {what}", path=root.url, hint=_hint_of(mine, err)
            ) from err
        if request.written is not None:
            request.written.set()
        name = state_file(rank)
        with store.open_write(name) as f:
            f.write(request.skeleton)
        return {**writer.entries, name: FileEntry(len(request.skeleton), Crc32c(request.skeleton).hexdigest())}

    return commit_written(
        root, plan, write_files, group=group, step=request.step, epoch=request.epoch, run_id=request.run_id,
        stats=request.stats, tensor_bytes=tensor_bytes, started=started,
    )  # fmt: skip


def prepare_path(root: Store, group: pdist.ProcessGroup | None) -> WritePlan:
    """Every rank of ``group``: rank 0 decides where a save to ``root`` writes and makes the
    directory (write/replace.py ``plan_write``); every rank returns its plan or its error."""

    def prepare() -> WritePlan:
        decided = plan_write(root)
        decided.data(root).makedirs()
        return decided

    return agree.decide(prepare, group, what="preparing the checkpoint path", **_FAILED)


def commit_written(
    root: Store,
    plan: WritePlan,
    write_files: Callable[[], dict[str, FileEntry]],
    *,
    group: pdist.ProcessGroup | None,
    step: int,
    epoch: int,
    run_id: str | None = None,
    stats: dict[str, float] | None = None,
    tensor_bytes: int = 0,
    started: float | None = None,
) -> Manifest:
    """Every rank of ``group``: ``write_files()`` (this rank's files in ``plan.data(root)``,
    returning their sizes and CRC32C), then the commit: once every rank's files are written
    (a gather), rank 0 writes the manifest listing all of them, last. Returns the committed
    manifest on every rank, or raises the same error on every rank (nothing committed).
    ``started``: the ``time.perf_counter()`` the manifest's ``write_s`` counts from (default: now).
    """
    started = time.perf_counter() if started is None else started
    world = pdist.world_size(group) if group else 1
    written: list[dict[str, FileEntry]] = []
    try:
        written = _on_every_rank(write_files, group, root, "writing checkpoint files")
        manifest = Manifest(
            step=step,
            epoch=epoch,
            world_size=world,
            files={name: entry for rank_entries in written for name, entry in rank_entries.items()},
            tensor_bytes=tensor_bytes,
            stats={**(stats or {}), "write_s": time.perf_counter() - started},
            extra=plan.manifest_extra,
            run_id=run_id,
        )
        # Commit metadata only after all ranks completed writing (the gather above). Rank 0
        # commits; every rank gets its outcome. A CheckpointExistsError (the create-only
        # commit found another writer's manifest: theirs stands) is raised as such on every rank.
        target = plan.commit_store(root)

        def commit() -> None:
            target.commit_bytes(MANIFEST_NAME, manifest.to_json(), exclusive=not plan.replace)
            if plan.mode == "beside":  # committed beside the path; it is saved once it is *at* it
                finish_write(root, plan)

        agree.decide(commit, group, what="committing the manifest", **_FAILED)
    except CheckpointError as err:
        _raise_if_lost(err, root, plan, written, step, group)
        raise
    if (pdist.rank(group) if group else 0) == 0 and plan.mode != "beside":
        finish_write(root, plan)  # only deletes what was replaced; logs its own failures
    return manifest


def _raise_if_lost(
    err: CheckpointError,
    root: Store,
    plan: WritePlan,
    written: list[dict[str, FileEntry]],
    step: int,
    group: pdist.ProcessGroup | None,
) -> None:
    """Every rank (the failure is agreed): when another writer committed this path while we
    wrote (its manifest beat ours, or its clean-up took our files), delete what this save
    wrote on rank 0 and raise :class:`CheckpointExistsError` saying so; else return."""
    if plan.replace:  # we meant to replace the manifest: a failure here is a plain failure
        return
    target = plan.commit_store(root)

    def lost() -> bool:
        if not isinstance(err, CheckpointExistsError) and target.stat(MANIFEST_NAME) is None:
            return False
        if written:  # our files are unreferenced: the committed manifest names the winner's
            try:
                abandon(root, plan, [name for entries in written for name in entries])
            except Exception as cleanup_err:  # leftovers of ours; the outcome stands
                log.warning("lightning_preempt: could not delete this save's files at %s: %s", root.url, cleanup_err)
        return True

    if not agree.decide(lost, group, what="checking who committed the checkpoint", **_FAILED):
        return
    raise CheckpointExistsError(
        f"another writer committed {root.url} first; this save (step {step}) was not committed (the other "
        "writer's checkpoint is intact)",
        path=root.url,
        hint="Two processes saved to the same path at once. Give each job its own dirpath, or keep the "
        "PreemptionCallback's lease on (lease=True) so only one job writes a dirpath.",
    ) from err


def _dcp_failures(err: CheckpointException) -> str:
    """One line per failed rank instead of DCP's full tracebacks."""
    parts = []
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return "; ".join(parts)


_NBYTES = operator.attrgetter("nbytes")


def _on_every_rank(fn: Callable[[], T], group: pdist.ProcessGroup | None, root: Store, what: str) -> list[T]:
    """Every rank runs ``fn`` (its share of the work); every rank returns every rank's result,
    or raises the same :class:`CheckpointWriteError`: nothing was committed, every failed rank's
    error, and the first failed rank's own HINT (an error of ours already says what to do)."""
    outcomes, local_error = agree.gather(fn, group)
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return [o.value for o in outcomes]
    detail = "; ".join(f"rank {o.rank}: {_first_line(o)}" for o in failed)
    raise CheckpointWriteError(
        f"{what} failed, nothing was committed ({detail})",
        path=root.url,
        hint=next((o.hint for o in failed if o.hint), _STORAGE_HINT),
    ) from local_error


def _first_line(outcome: agree.Outcome) -> str:
    """``Type: first line of the message``, the type named as a traceback names it."""
    kind = outcome.error_type.removeprefix("builtins.")
    line = outcome.message.splitlines()[0] if outcome.message else ""
    return kind if line in ("", kind.rsplit(".", 1)[-1]) else f"{kind}: {line}"


def _hint_of(mine: BaseException | None, err: CheckpointException) -> str | None:
    """The HINT of the first error of ours among a failed ``dcp.save``'s causes."""
    failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
    for exc in [mine, *failures]:
        hint = getattr(exc, "hint", None)
        if isinstance(hint, str):
            return hint
    return None
