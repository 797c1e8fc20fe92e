"""The goodput ledger's writer: what the engine measured, written off the training thread.

Rank 0 writes each record as one create-only file under ``<dirpath>/.lp-ledger/<run id>/`` on
a thread of its own (a slow bucket never delays a step); a failed write is logged and
dropped. Every :data:`COMPACT_EVERY` records (or :data:`COMPACT_EVERY_BYTES`) this restart's
files are folded into one, so a week-long run keeps a bounded ledger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lightning_preempt.catalog.goodput import summarize
from lightning_preempt.catalog.ledger_reader import RunLedger, ledger_store, read_run
from lightning_preempt.errors import CheckpointError
from lightning_preempt.format import ledger_records as fmt
from lightning_preempt.format.names import ledger_compact_name, ledger_record_name
from lightning_preempt.storage.store import Store

log = logging.getLogger(__name__)

#: Records of one restart after which its single files are compacted.
COMPACT_EVERY = 256
#: ... or after this many bytes of them, whichever comes first: records with long text (an
#: error's line, a path) must not pile up single files of up to ``MAX_RECORD_BYTES`` each.
COMPACT_EVERY_BYTES = 64 << 10
#: A ``progress`` record (the last step seen, what a SIGKILL's steps lost are counted up to)
#: at most this often. Tests and the demo set it lower.
PROGRESS_EVERY_S = 10.0
_MAX_SEQ = 999_999


def process_start_time() -> float | None:
    """When this process started (Unix seconds), from ``/proc`` on Linux; ``None`` elsewhere."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime, since boot), counted after the ")" of the command name
        with open("/proc/uptime", "rb") as f:  # not /proc/stat's btime: whole seconds
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Ledger:
    """The ledger of one run, written by this process (see the module docstring).

    Args:
        dirpath: the checkpoint root; storage_options: its fsspec options.
        run_id: the run the records belong to (the engine's agreed run id).
        enabled: ``False``: record nothing (ranks other than 0, ``ledger=False``).
    """

    def __init__(self, dirpath: str, storage_options: dict[str, Any], run_id: str, *, enabled: bool = True) -> None:
        self.dirpath, self.storage_options, self.run_id = dirpath, storage_options, run_id
        self.enabled = enabled
        self.restart: int | None = None  # known once the writer listed the ledger
        #: This run's records before this process (read once, for the figures logged so far).
        self.prior = RunLedger(run_id)
        self.records: list[dict[str, Any]] = []  # this process's records, as queued
        self._lock = threading.Lock()
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._seq = 0
        self._written: list[tuple[int, str]] = []  # (seq, name) of this restart's single files
        self._compacted: tuple[int, str] | None = None  # (first seq, name) of this restart's compacted file
        self._totals = dict.fromkeys(fmt.SAVE_TOTALS, 0.0)  # of the saves compacted away
        self._written_bytes = 0  # of the single files not compacted yet
        self._failures = 0
        self._store: Store | None = None
        self._last_progress = float("-inf")
        self._thread = threading.Thread(target=self._run, name="lightning_preempt-ledger", daemon=True)
        if enabled:
            self._thread.start()
            self._queue.put(self._open)

    @classmethod
    def off(cls) -> Ledger:
        """A ledger that records nothing."""
        return cls("", {}, "", enabled=False)

    def __reduce__(self) -> tuple[Callable[[], Ledger], tuple[()]]:
        # A ledger belongs to one process (its thread, queue and lock): a pickled or deep-copied
        # one (ddp_spawn, Lightning's callback copies) records nothing; the engine's set-up
        # makes the process's own.
        return (Ledger.off, ())

    # ---- the training thread's side: queue a record (cheap) ------------------------------------
    def add(self, kind: str, **fields: Any) -> None:
        """Queue a record of ``kind`` (format/ledger_records.py lists the fields)."""
        if not self.enabled:
            return
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            record = fmt.make(kind, run=self.run_id, restart=self.restart if self.restart is not None else 0,
                              seq=seq, t=time.time(), **fields)  # fmt: skip
            self.records.append(record)
        self._queue.put(lambda: self._write(record))

    def error(self, step: int, err: BaseException) -> None:
        """An error that stops training (its first line; once, though the engine and then the
        front-end's exception hook both report an agreed one)."""
        text = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[: fmt.MAX_TEXT]
        with self._lock:
            last = self.records[-1] if self.records else None
        if last is None or last["kind"] != "error" or last["error"] != text:
            self.add("error", step=step, error=text)

    @contextlib.contextmanager
    def records_errors(self, step: int) -> Iterator[None]:
        """Record the :class:`~lightning_preempt.errors.CheckpointError` (an agreed one) that
        leaves the block, then let it go on."""
        try:
            yield
        except CheckpointError as err:
            self.error(step, err)
            raise

    def progress(self, step: int) -> None:
        """The last step seen, at most every :data:`PROGRESS_EVERY_S` seconds."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self.add("progress", step=step)

    def figures(self) -> dict[str, float]:
        """The run's figures so far, for the loggers: preemptions, restarts, steps lost, goodput
        (empty when nothing is recorded). Reads memory only."""
        if not self.enabled:
            return {}
        with self._lock:  # the earlier restarts' records and this process's
            restart = self.restart if self.restart is not None else 0
            records = [*self.prior.records, *({**r, "restart": restart} for r in self.records)]
            folded = dict(self.prior.folded_saves)
            if self._totals["count"]:  # this process's saves that compaction folded away
                folded[restart] = dict(self._totals)
        s = summarize(records, folded, running=True)
        out = {"preempt/preemptions": float(len(s["preemptions"])), "preempt/restarts": float(s["restarts"]),
               "preempt/steps_lost": float(s["steps_lost"])}  # fmt: skip
        if s["goodput"] is not None:
            out["preempt/goodput"] = s["goodput"]
        return out

    def flush(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the queued records to be written; whether they were."""
        if not self.enabled or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(max(0.0, timeout_s))

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (at most ``timeout_s``; 1 s once a write failed: the storage is
        likely still failing, and the end of training must not wait on it), then stop the thread."""
        if self._failures:
            timeout_s = min(timeout_s, 1.0)
        if self.enabled and self.flush(timeout_s):
            self._queue.put(None)
            self._thread.join(timeout_s)
        self.enabled = False

    # ---- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job()
            except Exception as err:
                self._failed("writing the ledger", err)

    def _open(self) -> None:
        store = ledger_store(self.dirpath, self.storage_options).child(self.run_id)
        notes: list[str] = []
        prior = read_run(store, self.run_id, notes)
        for note in notes:
            log.debug("lightning_preempt: ledger: %s", note)
        names = [e.name for e in store.entries() if e.kind == "file"]
        taken = [int(n[1:6]) for n in names if n[:1] == "r" and n[1:6].isdigit()]
        restart = max([*taken, *prior.restarts, -1]) + 1
        store.makedirs()
        with self._lock:
            self._store, self.prior, self.restart = store, prior, restart
            for record in self.records:  # queued before the restart number was known
                record["restart"] = restart

    def _write(self, record: dict[str, Any]) -> None:
        if self._store is None or self.restart is None or record["seq"] > _MAX_SEQ:
            return  # the ledger could not be opened (warned once)
        name = ledger_record_name(self.restart, record["seq"], record["kind"])
        data = fmt.encode(record)
        try:
            self._store.commit_bytes(name, data)
        except Exception as err:
            self._failed(f"writing {name}", err)
            return
        self._written.append((record["seq"], name))
        self._written_bytes += len(data)
        if len(self._written) >= COMPACT_EVERY or self._written_bytes >= COMPACT_EVERY_BYTES:
            self._compact()

    def _compact(self) -> None:
        """Fold this restart's single files (and its previous compacted file) into one."""
        store, restart = self._store, self.restart
        assert store is not None and restart is not None
        with self._lock:
            last = self._written[-1][0]
            mine = [r for r in self.records if r["seq"] <= last]
        first = self._compacted[0] if self._compacted is not None else mine[0]["seq"]
        mine = [r for r in mine if r["seq"] >= first]
        saves = [r for r in mine if r["kind"] == "save"]
        progress = [r for r in mine if r["kind"] == "progress"]
        dropped = saves[: -fmt.COMPACT_KEEPS_SAVES]
        drains = [r for r in mine if r["kind"] == "drain"]  # the newest kept, like saves (no totals yet)
        kept = [r for r in mine if r["kind"] not in ("save", "progress", "drain")] + saves[-fmt.COMPACT_KEEPS_SAVES :]
        kept += progress[-1:] + drains[-fmt.COMPACT_KEEPS_SAVES :]
        previous = self._totals
        totals = {
            "count": previous["count"] + len(dropped),
            "blocking_s": previous["blocking_s"] + sum(r["blocking_s"] for r in dropped),
            "committed_s": previous["committed_s"] + sum(r["committed_s"] or 0.0 for r in dropped),
            "bytes": previous["bytes"] + sum(r["bytes"] for r in dropped),
            "failed": previous["failed"] + sum(r["committed_s"] is None for r in dropped),
        }
        compact = {"format": fmt.FORMAT, "kind": "compact", "run": self.run_id, "restart": restart, "first": first,
                   "last": last, "t": time.time(), "records": sorted(kept, key=lambda r: r["seq"]), "saves": totals}  # fmt: skip
        fmt.check_compact(compact)
        name = ledger_compact_name(restart, first, last)
        try:
            store.commit_bytes(name, fmt.encode_compact(compact))
        except Exception as err:
            self._failed(f"compacting into {name}", err)
            return
        # The compacted file covers them: deleting them (or failing to) changes nothing a reader sees.
        old = [n for _, n in self._written] + ([self._compacted[1]] if self._compacted is not None else [])
        self._compacted, self._written = (first, name), []
        self._written_bytes = 0
        with self._lock:  # the in-memory copy keeps what the compacted file keeps, with its totals
            self.records = [r for r in self.records if r["seq"] > last or r in kept]
            self._totals = totals
        for n in old:
            try:
                store.rm_file(n)
            except Exception as err:
                log.debug("lightning_preempt: ledger: could not delete %s after compacting: %s", n, err)

    def _failed(self, what: str, err: BaseException) -> None:
        self._failures += 1
        first = str(err).splitlines()[0] if str(err) else ""
        if self._failures == 1:
            log.warning(
                "lightning_preempt: the goodput ledger failed %s (%s: %s); training goes on, the record is lost.\n"
                "HINT: check that %s is writable; `lightning-preempt report` falls back to the manifests.",
                what, type(err).__name__, first, self.dirpath,
            )  # fmt: skip
        else:
            log.debug("lightning_preempt: ledger: %s failed again: %s", what, first)


def start_fields(resumed_step: int, resumed_from: str | None, world_size: int, config: Any,
                 local_dirpath: str | None = None, *, memory_dirpath: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The fields of a ``start`` record (``config``: the engine's ``PreemptionConfig``;
    ``local_dirpath``, ``memory_dirpath``: the node-local tiers, to tell which tier the
    resume came from)."""
    roots = (("memory", memory_dirpath), ("local", local_dirpath))
    tier = None if resumed_from is None else next(
        (t for t, root in roots if root and resumed_from.startswith(root.rstrip("/") + "/")), "dirpath")  # fmt: skip
    started = process_start_time()
    now = time.time()
    return {
        "resumed_step": max(0, resumed_step), "resumed_from": resumed_from, "process_start_t": started,
        "startup_s": max(0.0, now - started) if started is not None else None, "world_size": max(1, world_size),
        "every_n_train_steps": config.every_n_train_steps, "every_n_seconds": config.every_n_seconds,
        "grace_period_s": config.grace_period_s, "host": socket.gethostname(), "pid": os.getpid(),
        "resumed_tier": tier,
    }  # fmt: skip


def record_save(ledger: Ledger, saver: Any, before: list[Any], kind: str, *, tier: str | None = None) -> None:
    """Queue, behind the save just made on the saver's job thread, its ``save`` record: the
    figures are final once it committed or failed (``saver``: the engine's ``Saver``;
    ``before``: its newest history record before the save, as a list of at most one;
    ``tier``: where it went, when not the disk tiers: ``memory`` for a tier-0 copy)."""
    if not ledger.enabled or saver.history[-1:] == before:
        return  # this rank did not save (a strategy where another rank writes)
    record = saver.history[-1]
    tier = tier or ("local" if saver.tiers is not None else "dirpath")

    def add() -> None:
        error = str(record.error).splitlines()[0] if record.error is not None and str(record.error) else None
        ledger.add("save", save_kind=kind, step=max(0, record.step), blocking_s=record.blocking_s,
                   committed_s=record.committed_s if record.error is None else None, bytes=record.bytes, tier=tier,
                   error=error if record.error is None else error or type(record.error).__name__)  # fmt: skip

    saver.submit(add)


def record_drain(ledger: Ledger, drain: Any) -> None:
    """The ``drain`` record of one finished upload to the remote tier (``drain``: the
    ``DrainRecord`` of tiers/two_tier.py; called on the drain thread, the ledger queues it)."""
    error = drain.error.splitlines()[0] if drain.error else None
    done = drain.skipped is None and error is None
    ledger.add("drain", step=max(0, drain.step), drained_s=drain.drained_s if done else None, bytes=drain.bytes,
               skipped=drain.skipped, error=error)  # fmt: skip


def record_preemption(ledger: Ledger, controller: Any, saver: Any, *, step: int) -> None:
    """The ``preemption`` record, written before the process exits (within the grace period
    left). ``controller``: the engine's ``PreemptionController``; ``saver``: its ``Saver``."""
    now_mono, now = time.monotonic(), time.time()
    origin = controller.origin
    notice = controller.notice
    done = [r.step for r in saver.history if r.committed_s is not None and r.error is None]
    committed = done[-1] if done else None
    exited = next((t for event, t in reversed(controller.timeline) if event.startswith("exiting")), now_mono)
    agreed_steps, agreed_s = controller.agreed_after
    ledger.add(
        "preemption",
        source=notice.source if notice is not None else "another rank",
        received_t=now - (now_mono - origin) if origin is not None else None,
        step=step, snapshot_step=committed, committed=committed == step,
        to_exit_s=exited - origin if origin is not None else None,
        steps_lost=max(0, step - committed) if committed is not None else None,
        # from the first signal on any rank to the agreed step (carried by the agreement)
        agreed_after_steps=agreed_steps, agreed_after_s=round(agreed_s, 4) if agreed_s is not None else None,
    )  # fmt: skip
    ledger.flush(max(0.0, min(5.0, controller.budget())))
