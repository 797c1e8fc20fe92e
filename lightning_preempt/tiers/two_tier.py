"""Two-tier checkpoints: commit to fast node-local storage, drain to a bucket in the background
(docs/two-tier.md: saves, SIGTERM, resume, retention, failures, ranks and nodes). A drain job
on its own thread streams the committed local files to the remote tier and commits them there
(manifest last, create-only); a failed drain is logged with a HINT and training goes on, a
failed local write falls back to the remote tier, and only when both fail does the save raise."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import posixpath
import socket
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from typing import Any

from lightning_preempt.catalog.listing import CheckpointInfo, complete_local_checkpoints, list_checkpoints
from lightning_preempt.catalog.newest import OnSkip, newest_in_tiers
from lightning_preempt.catalog.ownership import remove_if_ours
from lightning_preempt.catalog.retention import retain
from lightning_preempt.catalog.verified import mark_verified
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointError, CheckpointWriteError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.read.verify import Verify
from lightning_preempt.storage.diagnose import describe, is_transient, redact
from lightning_preempt.storage.retry import Backoff
from lightning_preempt.storage.store import Store, join_url
from lightning_preempt.tiers.drain import drain_files
from lightning_preempt.write.jobs import JobQueue

log = logging.getLogger(__name__)

_DRAIN_HINT = (
    "The checkpoint is committed on the local tier ({local}) and training goes on; it is uploaded "
    "by a later drain or on the next start on this node. Check that {remote} is reachable and "
    "writable (credentials from storage_options / environment / gcloud or AWS defaults, bucket, "
    "endpoint_url)."
)
_LOCAL_HINT = (
    "The local tier ({local}) could not hold the checkpoint (disk full? not writable?); it was "
    "written directly to the remote tier instead, which is slower. Free space on the local disk "
    "or point local_dirpath at a bigger one (e.g. NVMe instead of /dev/shm)."
)


class DrainCancelled(Exception):
    """The drain ran past its deadline (emergency) or the plugin is closing."""


@dataclasses.dataclass
class DrainRecord:
    """One drain of a locally committed checkpoint to the remote tier (seconds, bytes)."""

    name: str
    step: int
    local_url: str
    remote_url: str
    queued: float
    started: float | None = None
    drained_s: float | None = None  # from start of the job to the remote commit
    bytes: int = 0
    attempts: int = 0
    skipped: str | None = None  # "superseded", "already there"
    error: str | None = None


@dataclasses.dataclass(eq=False, repr=False)
class TwoTier:
    """Tier bookkeeping and the drain thread for one :class:`ShardedAsyncCheckpointIO`.

    Args:
        local_root: node-local directory (NVMe, ``/dev/shm``…); no storage options.
        remote_options: fsspec options of the remote tier.
        max_workers: files uploaded in parallel per rank.
        retries: attempts per drain (1 = no retry) for transient errors.
        backoff_s: first retry delay; doubles each time.
    """

    local_root: str
    remote_options: dict[str, Any]
    _: dataclasses.KW_ONLY
    max_workers: int = 4
    retries: int = 4
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        self.local_root = str(self.local_root).rstrip("/") or str(self.local_root)
        self.retries = max(1, self.retries)
        self.remote_root: str | None = None
        self.keep_last_n: int | None = None
        self.run_id: str | None = None  # retention spares other runs' checkpoints
        self.group: pdist.ProcessGroup | None = None
        self.single_host = True
        self.leads_host = True  # this rank prunes the local tier of its host
        self.drains: list[DrainRecord] = []
        #: called with the byte count of every chunk a drain uploads (drain threads); may raise
        self.progress: Callable[[int], None] | None = None
        #: called (drain thread, rank 0 of the drain) with each finished drain's record, for the ledger
        self.on_drain: Callable[[DrainRecord], None] | None = None
        self._writer = JobQueue("lightning_preempt-drain")
        self._lock = threading.Lock()
        self._queued: list[str] = []
        self._futures: list[Future[Any]] = []
        self._deadline: float | None = None
        self._cancel = threading.Event()

    def configure(self, remote_root: str | None, keep_last_n: int | None, group: pdist.ProcessGroup | None) -> None:
        """Set the remote root and retention; ``group`` (a gloo group only the drain thread
        uses) makes drains collective. Collective when ``group`` is given."""
        if remote_root is not None:
            self.remote_root = str(remote_root).rstrip("/") or str(remote_root)
        self.keep_last_n = keep_last_n
        self.group = group
        hosts = pdist.all_gather_objects(socket.gethostname(), group)
        me = pdist.rank(group) if group is not None else 0
        self.single_host = len(set(hosts)) == 1
        self.leads_host = hosts.index(hosts[me]) == me

    def local_twin(self, remote_url: str) -> str | None:
        """``<local_root>/<name>`` for a checkpoint URL under the remote root, else ``None``."""
        url = str(remote_url).rstrip("/")
        if url.startswith(self.local_root + "/") or url == self.local_root:
            return None  # already a local path
        root = (self.remote_root if self.remote_root is not None else posixpath.dirname(url)).rstrip("/")
        return join_url(self.local_root, url[len(root) + 1 :]) if url.startswith(root + "/") else None

    def remote_twin(self, local_url: str) -> str | None:
        url = str(local_url).rstrip("/")
        if self.remote_root is None or not url.startswith(self.local_root + "/"):
            return None
        return join_url(self.remote_root, url[len(self.local_root) + 1 :])

    def save(
        self, write: Callable[[str, dict[str, Any]], Manifest], remote_url: str, local_url: str, step: int
    ) -> Manifest:
        """Writer thread: commit locally (``write(url, options)``), then queue the drain.

        If the local tier fails, write the remote tier directly; raise only when both fail.
        """
        try:
            manifest = write(local_url, {})
        except CheckpointWriteError as local_err:  # (not CheckpointExistsError: raised as it is)
            log.error(
                "lightning_preempt: local commit of %s failed (%s); writing %s directly\nHINT: %s",
                local_url,
                str(local_err).splitlines()[0],
                remote_url,
                _LOCAL_HINT.format(local=self.local_root),
            )
            try:
                manifest = write(remote_url, self.remote_options)
                self._writer.submit(lambda: self._retention(self.group))  # per tier, as after a drain
                return manifest
            except CheckpointError as remote_err:
                raise CheckpointWriteError(
                    f"no tier could hold the checkpoint of step {step}: local {local_url}: "
                    f"{str(local_err).splitlines()[0]}; remote {remote_url}: "
                    f"{redact(str(remote_err).splitlines()[0], self.remote_options)}",
                    path=remote_url,
                    hint="Free local disk space and check the remote tier (reachable, credentials, bucket); "
                    "earlier committed checkpoints are intact.",
                ) from remote_err
        self.queue_drain(local_url, remote_url, step)
        return manifest

    def queue_drain(self, local_url: str, remote_url: str, step: int, *, solo: bool = False) -> Future[Any]:
        """Queue a drain of the committed ``local_url``; every rank must queue the same
        drains in the same order unless ``solo`` (this rank uploads everything, no collectives)."""
        name = posixpath.basename(local_url.rstrip("/"))
        record = DrainRecord(name, step, local_url, remote_url, queued=time.perf_counter())
        with self._lock:
            self._queued.append(name)
            self.drains.append(record)
            del self.drains[:-64]  # the newest drains are enough for reports and tests
            self._futures = [f for f in self._futures if not f.done()]
            fut = self._writer.submit(lambda: self._drain_job(record, solo))
            self._futures.append(fut)
        return fut

    # ---- the drain job (drain thread) --------------------------------------------------
    def _drain_job(self, record: DrainRecord, solo: bool) -> DrainRecord:
        group = None if solo else self.group
        try:
            with self._lock:
                newer_queued = self._queued.index(record.name) < len(self._queued) - 1
            if pdist.broadcast_object(newer_queued, group):
                record.skipped = "superseded"
                log.info("lightning_preempt: drain of %s skipped: a newer checkpoint is queued", record.name)
            else:
                self._drain(record, group)
        except CheckpointError as err:
            record.error = str(err)
            log.error("lightning_preempt: %s", err)
        finally:
            with self._lock:
                if record.name in self._queued:
                    self._queued.remove(record.name)
            if not solo:
                self._retention(group)
            if self.on_drain is not None and pdist.rank(group) == 0:
                try:
                    self.on_drain(record)
                except Exception as err:  # bookkeeping: never fails a drain
                    log.debug("lightning_preempt: recording the drain of %s failed: %s", record.name, err)
        return record

    def _drain(self, record: DrainRecord, group: pdist.ProcessGroup | None) -> None:
        record.started = time.perf_counter()
        src = Store(record.local_url)
        dst = Store(record.remote_url, self.remote_options)

        def check_deadline(n: int) -> None:
            if self.progress is not None:
                self.progress(n)
            if self._cancel.is_set() or (self._deadline is not None and time.monotonic() > self._deadline):
                raise DrainCancelled("the drain ran out of time (grace period) or was cancelled")

        def give_up(delay: float) -> bool:
            return self._deadline is not None and time.monotonic() + delay > self._deadline

        policy = Backoff(self.retries, self.backoff_s, transient=lambda err: is_transient(err, (DrainCancelled,)),
                         give_up=give_up)  # fmt: skip
        outcome = drain_files(
            src, dst, group=group, max_workers=self.max_workers, progress=check_deadline, policy=policy,
            describe=lambda err: describe(err, self.remote_options),
            hint=_DRAIN_HINT.format(local=record.local_url, remote=record.remote_url),
        )  # fmt: skip
        record.bytes = outcome.manifest.total_bytes
        record.attempts = outcome.attempts
        record.drained_s = time.perf_counter() - record.started
        if outcome.already_there:
            record.skipped = "already there"
            return
        if pdist.rank(group) == 0:  # each file was checked against the manifest as it streamed
            mark_verified(record.remote_url, outcome.manifest)
        log.info(
            "lightning_preempt: drained %s -> %s (step %d, %.1f MB) in %.2fs",
            record.local_url, record.remote_url, record.step, record.bytes / 1e6, record.drained_s,
        )  # fmt: skip

    # ---- retention (drain thread, after each drain) ------------------------------------
    def _retention(self, group: pdist.ProcessGroup | None) -> None:
        """Per tier, rank 0 decides (catalog/retention.py); other hosts' local disks hold their
        ranks' shares of the same checkpoints, so their first ranks delete the same names."""
        keep = self.keep_last_n
        if keep is None:
            return
        doomed: list[str] = []
        if group is None or pdist.rank(group) == 0:
            with self._lock:
                protect = frozenset(self._queued)
            removed = retain(self.local_root, keep, {}, protect=protect, run_id=self.run_id)
            doomed = [posixpath.basename(p) for p in removed]
            if self.remote_root is not None:
                retain(self.remote_root, keep, self.remote_options, run_id=self.run_id)
        doomed = pdist.broadcast_object(doomed, group)
        if group is not None and pdist.rank(group) != 0 and self.leads_host and not self.single_host:
            for name in doomed:
                with contextlib.suppress(Exception):  # CheckpointExistsError: holds files not ours
                    remove_if_ours(Store(join_url(self.local_root, name)), why="retention (rank 0's decision)")

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for every queued drain; with ``timeout_s`` stop waiting at that point and make
        the running and queued drains give up. Returns whether all drains finished."""
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        self._deadline = deadline
        with self._lock:
            futures = list(self._futures)
        running = sum(not f.done() for f in futures)
        if running:
            log.info("lightning_preempt: waiting for %d drain(s) to the remote tier", running)
        try:
            for fut in futures:
                # (a far deadline overflows the lock's wait: OverflowError)
                left = None if deadline is None else max(0.0, deadline - time.monotonic() + 0.5)
                remaining = None if left is None else min(left, threading.TIMEOUT_MAX)
                with contextlib.suppress(Exception):  # errors were logged by the job
                    fut.exception(timeout=remaining)
            finished = all(f.done() for f in futures)
            if not finished:
                self._cancel.set()
            return finished
        finally:
            self._deadline = None

    def close(self, timeout_s: float | None = None) -> None:
        self.wait(timeout_s)
        self._writer.close()
        self._cancel.clear()

    def committed(self, url: str) -> bool:
        """Whether ``url`` holds a manifest; an error that does not say "absent" is raised."""
        local = url == self.local_root or url.startswith(self.local_root + "/")
        return Store(url, {} if local else self.remote_options).stat(MANIFEST_NAME) is not None

    def holders(self, remote_url: str) -> list[str]:
        """Which tiers hold a committed copy of ``remote_url`` (``["local", "remote"]``…)."""
        local = self.local_twin(remote_url)
        out = []
        for tier, url in (("local", local), ("remote", remote_url)):
            try:
                if url is not None and self.committed(url):
                    out.append(f"{tier} ({url})")
            except Exception:
                out.append(f"{tier}: could not tell ({url})")
        return out

    def newest(
        self, *, verify: Verify, on_skip: OnSkip | None = None, exclude: Collection[str] = ()
    ) -> CheckpointInfo | None:
        """The newest valid checkpoint across both tiers (catalog/newest.py); local wins a tie."""
        return newest_in_tiers(self.local_root, self.remote_root, self.remote_options, local_usable=self.single_host,
                               verify=verify, on_skip=on_skip, exclude=exclude)  # fmt: skip

    def local_only(self) -> list[CheckpointInfo]:
        """Local committed checkpoints newer than the newest remote one (oldest first)."""
        if self.remote_root is None or not self.single_host:
            return []
        remote = list_checkpoints(self.remote_root, self.remote_options)
        floor = max((c.step for c in remote if c.committed), default=-1)
        return sorted((c for c in complete_local_checkpoints(self.local_root) if c.step > floor), key=lambda c: c.step)

