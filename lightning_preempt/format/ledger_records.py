"""The goodput ledger's records: what one is, how it is encoded, how a read one is checked.

A run's ledger is ``<dirpath>/.lp-ledger/<run id>/``, one small JSON object per file,
created once, never rewritten (a torn or lost write loses one record, never another's).
Records of one process (one *restart*) are numbered ``seq`` 0, 1, 2…; a *compacted* file
may later fold many in (the records it kept, totals of the saves it dropped), and a reader
then ignores the single files it covers.

:data:`FIELDS` lists each kind's fields and types (besides ``run``, ``restart``, ``seq`` and
``t``, wall time in Unix seconds; what they mean: docs/goodput.md, "The records"). Everything
read back is untrusted (docs/security.md): JSON only, sizes bounded, every field type-checked;
a record that fails is skipped by the reader with a note.
"""

from __future__ import annotations

import json
import math
from typing import Any

FORMAT = "lightning_preempt.ledger/1"
#: The largest single record read back (written ones are a few hundred bytes).
MAX_RECORD_BYTES = 16 << 10
#: The largest compacted file read back.
MAX_COMPACT_BYTES = 1 << 20
#: Save records a compacted file keeps verbatim (the newest ones; the plot draws them).
COMPACT_KEEPS_SAVES = 64
#: Longest text field kept (an error's first line, a path).
MAX_TEXT = 400

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_NONE = (type(None),)
_COMMON: dict[str, tuple[type, ...]] = {"run": _STR, "restart": _INT, "seq": _INT, "t": _NUM}
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "start": {
        "resumed_step": _INT, "resumed_from": _STR + _NONE, "process_start_t": _NUM + _NONE, "startup_s": _NUM + _NONE,
        "world_size": _INT, "every_n_train_steps": _INT + _NONE, "every_n_seconds": _NUM + _NONE,
        "grace_period_s": _NUM, "host": _STR, "pid": _INT,
    },
    "save": {
        "save_kind": _STR, "step": _INT, "blocking_s": _NUM, "committed_s": _NUM + _NONE, "bytes": _INT,
        "tier": _STR, "error": _STR + _NONE,
    },
    "progress": {"step": _INT},
    "preemption": {
        "source": _STR, "received_t": _NUM + _NONE, "step": _INT, "snapshot_step": _INT + _NONE,
        "committed": (bool,), "to_exit_s": _NUM + _NONE, "steps_lost": _INT + _NONE,
    },
    "error": {"step": _INT, "error": _STR},
    "finish": {"step": _INT},
    "failure": {
        "lost": _STR, "survivors": _INT, "world_size": _INT, "step": _INT, "agreed_step": _INT + _NONE,
        "silent_s": _NUM, "quorum": (bool,), "agreed": (bool,), "writer_rank": _INT,
    },
    "drain": {"step": _INT, "drained_s": _NUM + _NONE, "bytes": _INT, "skipped": _STR + _NONE, "error": _STR + _NONE},
}  # fmt: skip
#: Fields a record may lack (written by newer versions only); checked when present.
OPTIONAL: dict[str, dict[str, tuple[type, ...]]] = {
    "start": {"resumed_tier": _STR + _NONE},
    # from the first signal (any rank) to the agreed step: steps and seconds
    "preemption": {"agreed_after_steps": _INT + _NONE, "agreed_after_s": _NUM + _NONE},
}
#: The sequence number of a ``failure`` record: one per restart (create-only), after any the
#: leader's writer numbers (it stops at 999_999 records, compacting every 256).
FAILURE_SEQ = 999_000
#: Totals a compacted file keeps of the save records it dropped.
SAVE_TOTALS = ("count", "blocking_s", "committed_s", "bytes", "failed")


class LedgerRecordError(ValueError):
    """A record that is damaged, oversized or not ours (the reader skips it with this note)."""


def encode(record: dict[str, Any]) -> bytes:
    """One record as the bytes of its file (checked first: the writer never writes what the
    reader would skip)."""
    check(record)
    return json.dumps(record, separators=(",", ":"), allow_nan=False).encode()


def encode_compact(compact: dict[str, Any]) -> bytes:
    """A compacted file's bytes (checked first; refused when over :data:`MAX_COMPACT_BYTES`)."""
    check_compact(compact)
    data = json.dumps(compact, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_COMPACT_BYTES:
        raise LedgerRecordError(f"a compacted file of {len(data)} bytes is over {MAX_COMPACT_BYTES}")
    return data


def make(kind: str, *, run: str, restart: int, seq: int, t: float, **fields: Any) -> dict[str, Any]:
    """A record of ``kind``; text fields are cut to :data:`MAX_TEXT` characters."""
    fields = {k: (v[:MAX_TEXT] if isinstance(v, str) else v) for k, v in fields.items()}
    return {"format": FORMAT, "kind": kind, "run": run, "restart": restart, "seq": seq, "t": t, **fields}


def decode(data: bytes, *, max_bytes: int = MAX_RECORD_BYTES) -> dict[str, Any]:
    """A record (or a compacted file) from its bytes, checked field by field."""
    if len(data) > max_bytes:
        raise LedgerRecordError(f"larger than the {max_bytes} bytes allowed")
    try:
        record = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise LedgerRecordError(f"not JSON ({type(err).__name__})") from None
    if not isinstance(record, dict):
        raise LedgerRecordError("not a JSON object")
    if record.get("kind") == "compact":
        check_compact(record)
    else:
        check(record)
    return record


def check(record: Any) -> None:
    """Raise :class:`LedgerRecordError` unless ``record`` is a well-formed record."""
    if not isinstance(record, dict):
        raise LedgerRecordError("not a JSON object")
    if record.get("format") != FORMAT:
        raise LedgerRecordError(f"format is not {FORMAT!r}")
    kind = record.get("kind")
    spec = FIELDS.get(kind) if isinstance(kind, str) else None
    if spec is None:
        raise LedgerRecordError("unknown kind")
    for name, types in {**_COMMON, **spec}.items():
        _check_value(name, record.get(name, _MISSING), types)
    for name, types in OPTIONAL.get(str(kind), {}).items():
        if name in record:
            _check_value(name, record[name], types)


def check_compact(record: dict[str, Any]) -> None:
    """A compacted file: its range, the records it kept (each checked) and the save totals."""
    if record.get("format") != FORMAT:
        raise LedgerRecordError(f"format is not {FORMAT!r}")
    for name, types in {"run": _STR, "restart": _INT, "first": _INT, "last": _INT, "t": _NUM}.items():
        _check_value(name, record.get(name, _MISSING), types)
    kept, totals = record.get("records"), record.get("saves")
    if not isinstance(kept, list) or not isinstance(totals, dict):
        raise LedgerRecordError("a compacted file needs 'records' (a list) and 'saves' (an object)")
    for item in kept:
        check(item)
        if item["run"] != record["run"] or item["restart"] != record["restart"]:
            raise LedgerRecordError("a compacted file holds another run's or restart's record")
    for name in SAVE_TOTALS:
        _check_value(f"saves.{name}", totals.get(name, _MISSING), _NUM)


_MISSING = object()


def _check_value(name: str, value: Any, types: tuple[type, ...]) -> None:
    if value is _MISSING:
        raise LedgerRecordError(f"field {name!r} is missing")
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise LedgerRecordError(f"field {name!r} has the wrong type")
    if isinstance(value, float) and not math.isfinite(value):
        raise LedgerRecordError(f"field {name!r} is not finite")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value < 2**53:
        raise LedgerRecordError(f"field {name!r} is out of range")
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise LedgerRecordError(f"field {name!r} is longer than {MAX_TEXT} characters")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")
