"""Reading the goodput ledger under a checkpoint root (format/ledger_records.py). Everything is
untrusted: bounded, checked, and skipped with a note (the caller escapes it) when it fails.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lightning_preempt.errors import CheckpointError
from lightning_preempt.format import ledger_records as fmt
from lightning_preempt.format.names import LEDGER_COMPACT_RE, LEDGER_DIR, LEDGER_RECORD_RE, LEDGER_RUN_RE
from lightning_preempt.storage.store import Store

#: Files read per run at most (a compacting writer keeps far fewer).
MAX_FILES_PER_RUN = 20_000
#: Runs read at most (the newest by name order are not meaningful: all are listed, the cap is a bound).
MAX_RUNS = 1_000
_READERS = 16  # parallel reads: object stores answer each small GET in tens of milliseconds


@dataclasses.dataclass
class RunLedger:
    """One run's records, ordered by ``(restart, seq)``, and the totals of save records that
    compaction folded away, per restart."""

    run: str
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    folded_saves: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)

    @property
    def restarts(self) -> list[int]:
        return sorted({r["restart"] for r in self.records})


@dataclasses.dataclass
class LedgerRead:
    runs: dict[str, RunLedger]
    notes: list[str]


def ledger_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The ledger's directory under the checkpoint root ``url``."""
    return Store(url, storage_options).child(LEDGER_DIR)


def run_ids(store: Store) -> list[str]:
    """The run directories in the ledger (names that are not run ids are ignored)."""
    return [e.name for e in store.entries() if e.kind == "dir" and LEDGER_RUN_RE.fullmatch(e.name)][:MAX_RUNS]


def read_ledger(url: str, storage_options: dict[str, Any] | None = None, *, run: str | None = None) -> LedgerRead:
    """Every run's records under ``url`` (only ``run``'s when given)."""
    if run is not None and not LEDGER_RUN_RE.fullmatch(run):
        raise ValueError(f"not a run id: {run!r}")  # a path component: never "..", never "/"
    store = ledger_store(url, storage_options)
    notes: list[str] = []
    runs = {r: read_run(store.child(r), r, notes) for r in (run_ids(store) if run is None else [run])}
    return LedgerRead({k: v for k, v in runs.items() if v.records}, notes)


def read_run(store: Store, run: str, notes: list[str]) -> RunLedger:
    """One run's records (``store``: its directory), skipping what does not check out."""
    names = sorted(e.name for e in store.entries() if e.kind == "file")
    if len(names) > MAX_FILES_PER_RUN:
        notes.append(f"run {run}: {len(names)} ledger files, read the first {MAX_FILES_PER_RUN}")
        names = names[:MAX_FILES_PER_RUN]
    singles = [n for n in names if LEDGER_RECORD_RE.fullmatch(n)]
    compacts = [n for n in names if LEDGER_COMPACT_RE.fullmatch(n)]
    foreign = len(names) - len(singles) - len(compacts)
    if foreign:
        notes.append(f"run {run}: skipped {foreign} file(s) that are not ledger records")

    def load(name: str) -> tuple[str, dict[str, Any] | str]:
        limit = fmt.MAX_COMPACT_BYTES if LEDGER_COMPACT_RE.fullmatch(name) else fmt.MAX_RECORD_BYTES
        try:
            return name, fmt.decode(store.read_bytes(name, limit), max_bytes=limit)
        except fmt.LedgerRecordError as err:
            return name, str(err)
        except CheckpointError as err:  # oversized, not a regular file: the store's own words, without the path
            first = str(err).splitlines()[0].split(" (checkpoint: ")[0] if str(err) else type(err).__name__
            return name, first.removeprefix(f"{name} is ")
        except Exception as err:  # unreadable (gone meanwhile, permissions, oversized)
            return name, f"unreadable: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

    with ThreadPoolExecutor(_READERS, thread_name_prefix="lp-ledger-read") as pool:
        loaded = list(pool.map(load, compacts + singles))
    out = RunLedger(run)
    covered: dict[int, list[tuple[int, int]]] = {}  # restart -> compacted ranges
    best: dict[int, dict[str, Any]] = {}  # restart -> widest compacted file
    for name, got in loaded[: len(compacts)]:
        if isinstance(got, str) or got["run"] != run:
            notes.append(f"run {run}: skipped {name}: {got if isinstance(got, str) else 'another run'}")
            continue
        restart = got["restart"]
        covered.setdefault(restart, []).append((got["first"], got["last"]))
        if restart not in best or got["last"] - got["first"] > best[restart]["last"] - best[restart]["first"]:
            best[restart] = got
    for restart, compact in best.items():
        out.records += compact["records"]
        out.folded_saves[restart] = {k: float(compact["saves"][k]) for k in fmt.SAVE_TOTALS}
    for name, got in loaded[len(compacts) :]:
        if isinstance(got, str):
            notes.append(f"run {run}: skipped {name}: {got}")
            continue
        match = LEDGER_RECORD_RE.fullmatch(name)
        assert match is not None
        if got["run"] != run or (got["restart"], got["seq"], got["kind"]) != (int(match[1]), int(match[2]), match[3]):
            notes.append(f"run {run}: skipped {name}: its content does not match its name")
            continue
        if any(a <= got["seq"] <= b for a, b in covered.get(got["restart"], ())):
            continue  # folded into a compacted file (its deletion was interrupted)
        out.records.append(got)
    out.records.sort(key=lambda r: (r["restart"], r["seq"]))
    return out
