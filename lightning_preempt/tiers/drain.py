"""Draining: copy a committed checkpoint to another store (e.g. local disk -> ``gs://``).

The copy is committed exactly like a save: every data file first (in parallel, streamed
in chunks, each checked against the source manifest while it streams and against the
destination's size / CRC32C after it lands), then the manifest, last and create-only.
A failed drain leaves no manifest at the destination, so it never counts as a checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

from lightning_preempt.catalog.ownership import remove_if_ours
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointExistsError, CheckpointWriteError, CorruptCheckpointError
from lightning_preempt.format.manifest import FileEntry, Manifest, data_store, parse_manifest
from lightning_preempt.format.names import MANIFEST_NAME, writer_of
from lightning_preempt.read.verify import read_manifest
from lightning_preempt.storage import object_store
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.diagnose import describe as describe_error
from lightning_preempt.storage.protocols import GCS_PROTOCOLS
from lightning_preempt.storage.retry import Backoff, retry
from lightning_preempt.storage.store import CHUNK_BYTES, Store

log = logging.getLogger(__name__)

_HINT = (
    "The destination holds no committed copy (its partial files were removed where possible); "
    "the source checkpoint is untouched. Check that the destination is reachable and writable "
    "(credentials, bucket, endpoint) and run the drain again."
)


_ONE_ATTEMPT = Backoff()  # no retries


class _Cancelled(Exception):
    """Another file of the same drain failed: stop this one early."""


class _RanksFailed(Exception):
    """Copying failed on some rank (the same on every rank: the failures are gathered)."""

    def __init__(self, failures: list[tuple[int, tuple[bool, str]]], local_error: Exception | None) -> None:
        super().__init__("; ".join(f"rank {r}: {f[1]}" for r, f in failures))
        self.all_transient = all(f[0] for _, f in failures)
        self.local_error = local_error


@dataclasses.dataclass
class DrainOutcome:
    """What :func:`drain_files` did."""

    manifest: Manifest
    already_there: bool = False
    attempts: int = 0


def drain_files(
    src: Store,
    dst: Store,
    *,
    group: pdist.ProcessGroup | None = None,
    max_workers: int = 4,
    progress: Callable[[int], None] | None = None,
    policy: Backoff = _ONE_ATTEMPT,
    describe: Callable[[BaseException], str] = describe_error,
    hint: str = _HINT,
) -> DrainOutcome:
    """The one drain implementation: copy the committed checkpoint ``src`` to ``dst`` and
    commit it there (manifest last, create-only). Used by :func:`drain_checkpoint` (one
    process) and by the two-tier drain thread (collective).

    With ``group`` every rank of it calls this for the same checkpoint and uploads the files
    it wrote (``names.writer_of``); rank 0 prepares, decides retries and commits, and every rank
    returns the same outcome or raises the same error (:mod:`lightning_preempt.agree`).

    Args:
        progress: called with each chunk's byte count; may raise to stop the copy.
        policy: attempts for the copy and the commit (default: no retry), while its
            ``transient`` says the errors are worth it and its ``give_up`` (rank 0's) says no.
        describe: one line for an error in messages (e.g. with secrets redacted).
        hint: the HINT of the error raised when the drain fails.
    """
    rank = pdist.rank(group) if group is not None else 0

    def prepare() -> tuple[bytes, bool]:
        read_manifest(src)  # NotACheckpointError / CorruptCheckpointError with a HINT
        data = src.read_bytes(MANIFEST_NAME)  # committed manifests never change: copied verbatim
        with contextlib.suppress(FileNotFoundError):
            if dst.read_bytes(MANIFEST_NAME) == data:
                return data, True
            raise CheckpointExistsError(
                "the destination already holds a different committed checkpoint",
                path=dst.url,
                hint="Drain into a new path (e.g. one directory per step), or remove the destination checkpoint first.",
            )
        if dst.stat() is not None:  # uncommitted leftovers of an earlier attempt; never anyone else's files
            remove_if_ours(dst, why="uncommitted leftover of an earlier drain")
        return data, False

    manifest_bytes, already = agree.decide(prepare, group, what="preparing the drain")
    manifest = parse_manifest(manifest_bytes, path=src.url)
    outcome = DrainOutcome(manifest, already_there=already)
    if already:
        log.info("lightning_preempt: %s already holds this checkpoint; nothing to drain", dst.url)
        return outcome
    world = pdist.world_size(group) if group is not None else 1
    mine = [n for n in manifest.files if group is None or writer_of(n) % world == rank]

    def attempt(number: int) -> None:
        outcome.attempts = number
        failure: tuple[bool, str] | None = None
        local_error: Exception | None = None
        try:
            dst.makedirs()
            # a replaced checkpoint's files live in its generation dir (write/replace.py), same name at dst
            copy_files(data_store(src, manifest), data_store(dst, manifest), manifest, max_workers=max_workers,
                       progress=progress, names=mine)  # fmt: skip
        except Exception as err:
            failure, local_error = (policy.transient(err), describe(err)), err
        failures = [(r, f) for r, f in enumerate(pdist.all_gather_objects(failure, group)) if f is not None]
        if failures:  # raised alike on every rank, so every rank takes the same branch
            raise _RanksFailed(failures, local_error)

    def retrying(err: BaseException, number: int, delay: float) -> None:
        log.warning("lightning_preempt: drain to %s, attempt %d failed (%s); retrying in %.1fs",
                    dst.url, number, err, delay)  # fmt: skip

    # Clocks and deadlines are rank-local: rank 0 decides for all, so no rank retries (and
    # enters the next attempt's collectives) while another gives up.
    every_rank = dataclasses.replace(policy, transient=lambda err: getattr(err, "all_transient", False))
    try:
        retry(attempt, every_rank, on_retry=retrying, decide=lambda question: agree.decide(question, group),
              retry_on=(_RanksFailed,))  # fmt: skip
    except _RanksFailed as failed:
        if rank == 0:
            _remove_partial(dst)
        raise CheckpointWriteError(
            f"draining {src.url} to {dst.url} failed after {outcome.attempts} attempt(s), nothing was committed "
            f"there ({failed})",
            path=dst.url,
            hint=hint,
        ) from failed.local_error
    agree.decide(lambda: _commit(dst, manifest_bytes, policy, describe, hint), group,
                 what="committing the drained manifest")  # fmt: skip
    return outcome


def _commit(dst: Store, manifest_bytes: bytes, policy: Backoff, say: Callable[[BaseException], str], hint: str) -> None:
    """Rank 0: the commit, last, one small create-only PUT (retried while worth it); a failure
    removes the partial copy. :class:`CheckpointExistsError` is never retried nor cleaned up:
    someone else committed a different checkpoint there, and their files are left alone."""
    worth_it = dataclasses.replace(  # the commit retries without a deadline, as it always has
        policy, transient=lambda err: not isinstance(err, CheckpointExistsError) and policy.transient(err),
        give_up=lambda delay: False,
    )  # fmt: skip
    try:
        retry(lambda attempt: dst.commit_bytes(MANIFEST_NAME, manifest_bytes), worth_it)
    except CheckpointExistsError:
        raise
    except Exception as err:
        _remove_partial(dst)
        raise CheckpointWriteError(
            f"committing the manifest at {dst.url} failed, nothing was committed there: {say(err)}",
            path=dst.url,
            hint=hint,
        ) from err


def drain_checkpoint(
    src: Store,
    dst: Store,
    *,
    max_workers: int = 4,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Copy the committed checkpoint at ``src`` to ``dst`` and commit it there (one process).

    Args:
        src: a committed checkpoint directory (its manifest is read first).
        dst: where the copy goes; it must not hold a *different* committed checkpoint.
        max_workers: files uploaded in parallel (memory: about ``max_workers * (CHUNK_BYTES + upload block)``).
        progress: called with the byte count of every chunk copied (from worker
            threads, one call at a time), e.g. ``tqdm.update``.

    Returns:
        The manifest now committed at ``dst`` (byte-identical to the source's).

    Raises:
        NotACheckpointError: ``src`` has no committed checkpoint.
        CheckpointExistsError: ``dst`` already holds a different committed checkpoint.
        CheckpointWriteError: copying or committing failed; ``dst`` has no manifest.
            Its cause is a :class:`CorruptCheckpointError` when a source file does not
            match the source manifest.
    """
    started = time.perf_counter()
    outcome = drain_files(src, dst, max_workers=max_workers, progress=progress)
    if not outcome.already_there:
        log.info(
            "lightning_preempt: drained %s -> %s (%.1f MB, %d files) in %.2fs",
            src.url, dst.url, outcome.manifest.total_bytes / 1e6, len(outcome.manifest.files),
            time.perf_counter() - started,
        )  # fmt: skip
    return outcome.manifest


def copy_files(
    src: Store,
    dst: Store,
    manifest: Manifest,
    *,
    max_workers: int = 4,
    progress: Callable[[int], None] | None = None,
    names: list[str] | None = None,
) -> None:
    """Copy ``names`` (default: every file of ``manifest``) from ``src`` to ``dst`` in
    parallel, each checked against ``manifest`` while it streams and after it lands; the
    first failure stops the others and is raised. ``progress`` (bytes per chunk) may raise
    to stop the copy (the failed uploads are aborted). Commits nothing: the caller writes
    the manifest after every rank's copies landed (:func:`drain_files`, the peer replica)."""
    cancel = threading.Event()
    lock = threading.Lock()

    def report(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    # Biggest first: the long uploads start early and small files fill the gaps.
    names = sorted(manifest.files if names is None else names, key=lambda n: (-manifest.files[n].size, n))
    with ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix="lp-drain") as pool:
        futures: list[Future[None]] = [
            pool.submit(_copy_one, src, dst, name, manifest.files[name], cancel, report) for name in names
        ]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            cancel.set()
            for f in futures:
                f.cancel()
            wait(futures)
            errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
            first = next((e for e in errors if not isinstance(e, _Cancelled)), errors[0])
            assert first is not None
            raise first


def _copy_one(
    src: Store,
    dst: Store,
    name: str,
    entry: FileEntry,
    cancel: threading.Event,
    report: Callable[[int], None],
) -> None:
    crc = Crc32c()
    with src.open_read(name) as reader, dst.open_write(name) as writer:
        while chunk := reader.read(CHUNK_BYTES):
            if cancel.is_set():
                raise _Cancelled(name)
            crc.update(chunk)
            writer.write(chunk)
            report(len(chunk))
        # Check before the upload completes: a mismatch aborts it (open_write's failure path).
        if crc.nbytes != entry.size or crc.hexdigest() != entry.crc32c:
            raise CorruptCheckpointError(
                f"source file {name!r} does not match the source manifest "
                f"({crc.nbytes} bytes, crc32c {crc.hexdigest()}; expected {entry.size} bytes, crc32c {entry.crc32c})",
                path=src.url,
                hint="The source checkpoint is damaged; drain an older one.",
            )
    # The destination's own view of ``name``: size always, CRC32C where it is free (GCS).
    info = dst.info(name)  # fresh from the server
    size = int(info.get("size", -1))
    if size != entry.size:
        raise CorruptCheckpointError(
            f"uploaded {name!r} has {size} bytes at the destination, expected {entry.size}",
            path=dst.url,
            hint="The upload was truncated; run the drain again.",
        )
    remote = object_store.gcs_crc32c(info) if dst.protocol in GCS_PROTOCOLS else None
    if remote is not None and remote != entry.crc32c:
        raise CorruptCheckpointError(
            f"uploaded {name!r} has crc32c {remote} at the destination, expected {entry.crc32c}",
            path=dst.url,
            hint="The data was corrupted in transit; run the drain again.",
        )


def _remove_partial(dst: Store) -> None:
    """Best effort: the destination may be unreachable (that may be why we failed)."""
    try:
        remove_if_ours(dst, why="partial copy of a failed drain")
    except Exception as err:
        log.warning(
            "lightning_preempt: could not remove the partial copy at %s (%s); it has no manifest and does "
            "not count as a checkpoint",
            dst.url,
            describe_error(err),
        )
