"""One writer per dirpath: a create-only, heartbeated lease (docs/design.md, "One writer per dirpath").

After a requeue the old job may not be dead yet. Rank 0 takes the lease at ``setup``: the
highest generation of ``.lp-lease-<generation>.json`` holds it, and a new holder *creates*
the next one, so of two jobs exactly one wins. A lease is stale when released, its holder
dead on this host, or its heartbeat unchanged for ``timeout_s`` (watched here: clock skew
does not matter). A newer generation sets :attr:`lost`: training stops at the next agreed step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from lightning_preempt.errors import CheckpointError, CheckpointExistsError
from lightning_preempt.format.names import LEASE_GENERATION_MAX, LEASE_PREFIX, lease_generation, lease_name
from lightning_preempt.storage.store import Store

log = logging.getLogger(__name__)


class LeaseHeldError(CheckpointError):
    """Another live job holds the lease on this dirpath."""


class LeaseLostError(CheckpointError):
    """Another job took over this job's lease while it was running."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # not ours to signal, or not a pid: never taken for a dead holder
    return True


#: A lease record is a few hundred bytes; anything larger is not one.
MAX_LEASE_BYTES = 4096
#: Process ids are below 2**22 on Linux (``pid_max``), lower elsewhere.
MAX_PID = 2**22
_TEXT_FIELDS = ("token", "job", "host")
#: What names this job in a lease record (the first one set).
_JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "JOB_COMPLETION_INDEX", "KUBERNETES_POD_NAME", "HOSTNAME")


def _valid_record(data: Any) -> dict[str, Any]:
    """The fields of a lease record that have their type and range; others are dropped (a
    record without ``heartbeat_unix`` never advances, so it goes stale after the timeout)."""
    if not isinstance(data, dict):
        return {}
    out: dict[str, Any] = {}
    for key in _TEXT_FIELDS:  # printed in errors: printable and short
        value = data.get(key)
        if isinstance(value, str):
            out[key] = "".join(c if c.isprintable() and c.isascii() else "?" for c in value[:200])
    pid = data.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < MAX_PID:
        out["pid"] = pid
    beat = data.get("heartbeat_unix")
    if isinstance(beat, (int, float)) and not isinstance(beat, bool) and math.isfinite(beat):
        out["heartbeat_unix"] = float(beat)
    if isinstance(data.get("released"), bool):
        out["released"] = data["released"]
    return out


class Lease:
    """The lease on one dirpath, held by rank 0 of one job.

    Args:
        url: the dirpath (any fsspec URL).
        storage_options: fsspec options for ``url``.
        timeout_s: a heartbeat that does not advance for this long means the holder is dead.
        clock: wall-clock source (tests).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        timeout_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = Store(url, storage_options)
        self.timeout_s = timeout_s
        self.clock = clock
        self.token = uuid.uuid4().hex
        self.generation: int | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _generations(self) -> list[int]:
        """The lease generations present in dirpath, oldest first (a fresh listing)."""
        found = (lease_generation(e.name) for e in self.store.entries() if e.kind == "file")
        return sorted(g for g in found if g is not None)

    def _read(self, generation: int) -> dict[str, Any] | None:
        """The record of ``generation`` with only its well-formed fields (``{}``: damaged, a
        heartbeat that never advances), or ``None`` when it is gone. Other processes' input
        (docs/security.md): a size-bounded regular-file read, every field checked."""
        try:
            data = json.loads(self.store.read_bytes(lease_name(generation), MAX_LEASE_BYTES))
        except FileNotFoundError:
            return None
        except (ValueError, OSError, RecursionError, CheckpointError):
            return {}
        return _valid_record(data)

    def _record(self, heartbeat: float, released: bool = False) -> bytes:
        job = next((f"{var}={os.environ[var]}" for var in _JOB_VARS if os.environ.get(var)), None)
        record = {"token": self.token, "job": job, "host": socket.gethostname(), "pid": os.getpid(),
                  "heartbeat_unix": heartbeat, "released": released}  # fmt: skip
        return json.dumps(record, sort_keys=True).encode()

    def acquire(self, *, poll_s: float = 1.0) -> None:
        """Take the lease, waiting at most ``timeout_s`` for a silent holder to go stale.

        Raises:
            LeaseHeldError: the holder's heartbeat advanced while we watched.
        """
        self.store.makedirs()
        deadline = time.monotonic() + self.timeout_s + poll_s
        watched: tuple[int, Any] | None = None
        while True:
            gens = self._generations()
            if not gens:
                if self._try_create(1):
                    return
                continue
            top = gens[-1]
            if top >= LEASE_GENERATION_MAX:
                # The next generation's name would have 11 digits: invisible to every job, so a
                # second job would start again at generation 1 while this one holds the lease.
                raise LeaseHeldError(
                    f"the lease in this dirpath is at generation {top}, the last one its file names allow "
                    "(a damaged or planted lease file)",
                    path=self.store.url,
                    hint=f"If no other job writes to this dirpath, delete its {LEASE_PREFIX}*.json files and "
                    "restart; otherwise give this run its own dirpath.",
                )
            current = self._read(top)
            if current is None:  # deleted under us: look again
                continue
            if current.get("token") == self.token:
                self.generation = top
                return
            stale, why = self._is_stale(current, watched, top)
            if stale:
                log.info("lightning_preempt: taking over the lease on %s (%s)", self.store.url, why)
                if self._try_create(top + 1):
                    for old in self._generations():
                        if old <= top:
                            with contextlib.suppress(Exception):
                                self.store.rm_file(lease_name(old))
                    return
                continue  # another job took it first: look at theirs
            if watched is not None and watched[0] == top and watched[1] != current.get("heartbeat_unix"):
                raise self._held(current)
            if watched is None or watched[0] != top:
                watched = (top, current.get("heartbeat_unix"))
            if time.monotonic() > deadline:
                # Silent for the whole timeout: its holder is gone.
                watched = (top, "expired")
                continue
            time.sleep(poll_s)

    def _is_stale(self, current: dict[str, Any], watched: tuple[int, Any] | None, top: int) -> tuple[bool, str]:
        if current.get("released"):
            return True, "released by its holder"
        if watched is not None and watched == (top, "expired"):
            return True, f"no heartbeat for {self.timeout_s:.0f}s"
        pid = current.get("pid")
        if current.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            return True, f"its process {pid} on this host is gone"
        beat = current.get("heartbeat_unix")
        if isinstance(beat, (int, float)) and self.clock() - beat > 2 * self.timeout_s:
            return True, f"heartbeat {self.clock() - beat:.0f}s old"
        return False, ""

    def _held(self, current: dict[str, Any]) -> LeaseHeldError:
        return LeaseHeldError(
            f"another job is writing to this dirpath: job {current.get('job')}, host {current.get('host')}, "
            f"pid {current.get('pid')} (its heartbeat is advancing)",
            path=self.store.url,
            hint="Two jobs must not share a dirpath: wait for the other job to end (a requeued job's "
            "predecessor releases the lease when it exits), stop it, or give this run its own dirpath. "
            "PreemptionCallback(lease=False) turns the check off.",
        )

    def _try_create(self, generation: int) -> bool:
        try:
            self.store.commit_bytes(lease_name(generation), self._record(self.clock()), exclusive=True)
        except CheckpointExistsError:
            return False
        self.generation = generation
        return True

    def beat(self) -> None:
        """Refresh the heartbeat; sets :attr:`lost` when a newer generation exists."""
        if self.generation is None:
            return
        gens = self._generations()
        if gens and gens[-1] > self.generation:
            if not self.lost:
                log.error("lightning_preempt: the lease on %s was taken over by another job", self.store.url)
            self.lost = True
            return
        self.store.commit_bytes(lease_name(self.generation), self._record(self.clock()), exclusive=False)

    def start_heartbeat(self) -> None:
        """Beat every ``timeout_s / 4`` on a daemon thread until :meth:`release`."""
        if self._thread is not None:
            return
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(self.timeout_s / 4):
                try:
                    self.beat()
                except Exception as err:  # a storage hiccup: the next beat tries again
                    log.warning("lightning_preempt: lease heartbeat on %s failed: %s", self.store.url, err)

        self._thread = threading.Thread(target=run, name="lightning_preempt-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise :class:`LeaseLostError` when another job took the lease over."""
        if self.lost:
            raise LeaseLostError(
                "another job took over the lease on this dirpath while this one was running",
                path=self.store.url,
                hint="Two jobs were writing one dirpath (this one was suspended or cut off for longer than "
                "lease_timeout_s). This job stops so the other's checkpoints stay intact; restart it when the "
                "other ends, or give it its own dirpath.",
            )

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released (a successor takes over at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.generation is None or self.lost:
            return
        try:
            self.store.commit_bytes(lease_name(self.generation), self._record(self.clock(), released=True),
                                    exclusive=False)  # fmt: skip
        except Exception as err:
            log.warning("lightning_preempt: could not release the lease on %s: %s", self.store.url, err)
        self.generation = None
