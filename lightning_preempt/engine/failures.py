"""Unannounced failures: what every surviving rank does when a peer goes silent (the policy;
``collective/heartbeat.py`` is the mechanism; docs/failure-detection.md).

On the heartbeat thread (the training thread is likely stuck in a collective): log the loss;
the lowest survivor of a side holding at least half the world records a ``failure`` in the
ledger (within :data:`RECORD_BUDGET_S`); then ``os._exit(exit_code)`` so the launcher
restarts from the newest valid checkpoint. Nothing is committed after a loss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_preempt.catalog.ledger_reader import ledger_store
from lightning_preempt.collective import groups as pdist
from lightning_preempt.collective.heartbeat import Heartbeat, Verdict, route_source
from lightning_preempt.engine.config import PreemptionConfig
from lightning_preempt.engine.ledger_writer import Ledger
from lightning_preempt.errors import CheckpointError, CheckpointExistsError
from lightning_preempt.format import ledger_records as fmt
from lightning_preempt.format.names import LEDGER_COMPACT_RE, LEDGER_RECORD_RE, ledger_record_name
from lightning_preempt.preemption.controller import flush_logs

log = logging.getLogger(__name__)

#: The longest the failure record may take to write before the process exits anyway.
RECORD_BUDGET_S = 2.0
#: Heartbeats per timeout (the interval is ``timeout_s / HEARTBEATS_PER_TIMEOUT``).
HEARTBEATS_PER_TIMEOUT = 8


class FailureDetector:
    """One rank's detector: started in the engine's set-up (collective), stopped at close.

    Args:
        timeout_s: a rank silent this long is lost.
        exit_code: the code every survivor exits with.
        held: the steps this rank holds (newest committed ones).
        record: writes the failure record (``record(verdict)``), called on the writer only.
        exit: ends the process (``os._exit``; tests pass their own).
    """

    def __init__(self, *, timeout_s: float, exit_code: int, held: Callable[[], Sequence[int]],
                 record: Callable[[Verdict], None], exit: Callable[[int], None] = os._exit) -> None:  # fmt: skip
        self.timeout_s, self.exit_code = timeout_s, exit_code
        self._held, self._record, self._exit = held, record, exit
        self.heartbeat: Heartbeat | None = None
        self.settle_s = min(2.0, timeout_s / 2)
        self._acted = threading.Event()  # the verdict's policy ran (record written or given up)

    def start(self, group: Any) -> None:
        """Collective over ``group`` (every rank): share a key and the addresses, start beating."""
        rank, world = pdist.rank(group), pdist.world_size(group)
        key = pdist.broadcast_bytes(os.urandom(32) if rank == 0 else None, group, max_bytes=64)
        # where the other ranks reach this one (the route toward the rendezvous host), never
        # every interface; IPv4, as the heartbeat's socket; 127.0.0.1 for a job on one host
        host = route_source(os.environ.get("MASTER_ADDR", "127.0.0.1"), socket.AF_INET) or "127.0.0.1"
        hb = Heartbeat(rank, world, key=key, held=self._held, on_verdict=self._act,
                       interval_s=self.timeout_s / HEARTBEATS_PER_TIMEOUT, timeout_s=self.timeout_s,
                       settle_s=self.settle_s, host=host)  # fmt: skip
        addresses = pdist.all_gather_json([*hb.address, hb.incarnation], group, max_bytes=256)
        peers = {r: (str(a[0]), int(a[1])) for r, a in enumerate(addresses)}
        hb.start(peers, {r: str(a[2]) for r, a in enumerate(addresses)})
        self.heartbeat = hb

    def stop(self) -> None:
        """Leave cleanly: the peers stop watching this rank (no verdict)."""
        if self.heartbeat is not None:
            self.heartbeat.stop(bye=True)
            self.heartbeat = None

    def after_error(self, error: BaseException) -> None:
        """The training thread failed with ``error``: when it looks like a lost peer (a
        collective's error), wait for the heartbeats' verdict, which ends the process."""
        hb = self.heartbeat
        if hb is None or not _collective_error(error) or not hb.watching:
            return  # not a collective's error, or every peer left cleanly: nobody can be lost
        log.warning("lightning_preempt: %s: waiting up to %.0f s for the heartbeats to tell whether a rank was lost",
                    type(error).__name__, self.timeout_s + self.settle_s)  # fmt: skip
        with _deferred_sigterm() as deferred:
            # The launcher may tear this worker down meanwhile: when the lost node hosted the
            # c10d store, the survivors' agents fail at once and SIGTERM their workers, well
            # before the verdict. Dying then would leave no failure record; the wait is
            # bounded (the verdict, its record, the exit), and a SIGTERM is acted on after it.
            if hb.wait_verdict(self.timeout_s + self.settle_s + RECORD_BUDGET_S + 1.0) is not None:
                self._acted.wait(RECORD_BUDGET_S + 1.0)  # the verdict's record, then its exit
            if deferred:
                log.warning("lightning_preempt: a SIGTERM came while waiting for the heartbeats; acting on it now")

    # ---- on the heartbeat thread -------------------------------------------------------------
    def _act(self, verdict: Verdict) -> None:
        lost = ",".join(map(str, verdict.lost))
        log.error(
            "lightning_preempt: rank(s) %s silent for %.1f s: lost without a signal (SIGKILL, power, network). "
            "%d of %d ranks remain%s; the newest step every survivor holds: %s. Exiting with code %d so the "
            "launcher or scheduler restarts the job from the newest valid checkpoint.\n"
            "HINT: run under `torchrun --max-restarts N` (or a scheduler that requeues on exit code %d); "
            "docs/failure-detection.md.",
            lost, verdict.silent_s, len(verdict.survivors), verdict.world,
            "" if verdict.quorum else " (no quorum: this side records nothing)",
            verdict.agreed_step if verdict.agreed_step is not None else "none", self.exit_code, self.exit_code,
        )  # fmt: skip
        # A tie (half the world on each side) tries too: the create-only record lets one side win.
        if 2 * len(verdict.survivors) >= verdict.world and verdict.rank == verdict.writer:
            writer = threading.Thread(target=self._record, args=(verdict,), name="lightning_preempt-failure-record",
                                      daemon=True)  # fmt: skip
            writer.start()
            writer.join(RECORD_BUDGET_S)
            if writer.is_alive():
                log.error("lightning_preempt: the failure record did not complete within %.0f s", RECORD_BUDGET_S)
        flush_logs()
        self._acted.set()
        self._exit(self.exit_code)


@contextlib.contextmanager
def _deferred_sigterm() -> Any:
    """Hold SIGTERM inside the block (main thread only; elsewhere nothing changes): yields a
    list that is non-empty once one came; on leaving, the previous handler is put back and
    a held SIGTERM is sent again, to it."""
    got: list[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    except ValueError:  # not the main thread: signals cannot be handled here anyway
        yield got
        return
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)
        if got:
            os.kill(os.getpid(), signal.SIGTERM)


def _collective_error(error: BaseException) -> bool:
    if isinstance(error, (CheckpointError, SystemExit, KeyboardInterrupt)):
        return False
    text = f"{type(error).__name__} {error}".lower()
    return any(w in text for w in ("dist", "gloo", "nccl", "connection", "peer", "timeout", "timed out", "socket"))


def write_failure_record(dirpath: str, storage_options: dict[str, Any], run_id: str, verdict: Verdict, *,
                         step: int, restart: int | None) -> bool:  # fmt: skip
    """The ``failure`` record of ``verdict`` (create-only, ``seq`` :data:`~lightning_preempt.format.ledger_records.FAILURE_SEQ`):
    whether this rank wrote it (``False``: the other side of a partition did first)."""
    store = ledger_store(dirpath, storage_options).child(run_id)
    number = restart  # the leader's own; else the highest restart with a record (the leader wrote our start)
    if number is None:
        matches = (LEDGER_RECORD_RE.fullmatch(e.name) or LEDGER_COMPACT_RE.fullmatch(e.name) for e in store.entries())
        number = max((int(m[1]) for m in matches if m is not None), default=0)
    record = fmt.make(
        "failure", run=run_id, restart=number, seq=fmt.FAILURE_SEQ, t=time.time(),
        lost=",".join(map(str, verdict.lost)), survivors=len(verdict.survivors), world_size=verdict.world,
        step=max(0, step), agreed_step=verdict.agreed_step, silent_s=max(0.0, verdict.silent_s),
        quorum=verdict.quorum, agreed=verdict.agreed, writer_rank=verdict.rank,
    )  # fmt: skip
    try:
        store.commit_bytes(ledger_record_name(number, fmt.FAILURE_SEQ, "failure"), fmt.encode(record))
    except CheckpointExistsError:
        log.error("lightning_preempt: another group of survivors recorded this failure first (a partition); "
                  "this one records nothing")  # fmt: skip
        return False
    log.info("lightning_preempt: recorded the loss of rank(s) %s in the ledger (restart %d)", record["lost"], number)
    return True


def start_detector(config: PreemptionConfig, group: Any, *, run_id: str, ledger: Ledger,
                   held: Callable[[], Sequence[int]], step: Callable[[], int]) -> FailureDetector | None:  # fmt: skip
    """The heartbeats (collective), or ``None``: on with ``detect_failures``, or by default
    when the job has more than one rank. ``step``: the newest step seen (for the record)."""
    wanted = config.detect_failures if config.detect_failures is not None else pdist.world_size(group) > 1
    if not wanted or group is None:
        return None

    def record(verdict: Verdict) -> None:
        if config.ledger:
            write_failure_record(config.dirpath, config.storage_options, run_id, verdict,
                                 step=step(), restart=ledger.restart if ledger.enabled else None)  # fmt: skip

    detector = FailureDetector(timeout_s=config.heartbeat_timeout_s, exit_code=config.failure_exit_code,
                               held=held, record=record)  # fmt: skip
    detector.start(group)
    return detector
