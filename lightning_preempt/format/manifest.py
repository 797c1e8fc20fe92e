"""The manifest: a versioned JSON file, written last, that makes a checkpoint exist.

It lists every file with its size and CRC32C. It is untrusted input (docs/security.md):
:meth:`Manifest.from_json` checks every field, :func:`parse_manifest` every file name. One
that fails is *corrupt*; only a well-formed, larger ``version`` is *newer*.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Any

from lightning_preempt.errors import CorruptCheckpointError, UnsupportedFormatError
from lightning_preempt.format.names import is_checkpoint_file, is_generation, is_safe_file_name
from lightning_preempt.storage.store import Store

FORMAT_NAME = "lightning_preempt.checkpoint"
#: 2: state files may hold inline tensors (0.2.0), so a reader of 1 says "too new", not
#: "untrusted". Version 1 checkpoints still load.
FORMAT_VERSION = 3

#: Larger manifests are refused unread (a 4096-rank checkpoint's is well under 1 MiB).
MAX_MANIFEST_BYTES = 32 << 20
#: Most files one manifest may list: 131,072 ranks at one writer thread each (~2.5 s to
#: parse); a crafted larger one would hold ``ls`` for many seconds.
MAX_MANIFEST_FILES = 1 << 18

_CRC_RE = re.compile(r"[0-9a-f]{8}")
_MAX_INT = 2**63 - 1
_MAX_UNIX = 253402300799.0  # 9999-12-31T23:59:59Z: the last second datetime can show
_MAX_RUN_ID = 256
_KNOWN_KEYS = frozenset(
    {"format", "version", "step", "epoch", "world_size", "created_unix", "tensor_bytes", "stats", "extra", "files",
     "run_id"}
)  # fmt: skip
_DAMAGED_HINT = (
    "The checkpoint is damaged or was not written by lightning_preempt; delete it or resume from an older one."
)


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size in bytes and CRC32C (8 hex digits)."""

    size: int
    crc32c: str


@dataclasses.dataclass
class Manifest:
    """What a committed checkpoint holds. Serialised as JSON with ``format`` and ``version``.

    ``run_id`` (optional) names the run that wrote it; retention given a run id never
    deletes checkpoints of another run.
    """

    step: int
    epoch: int
    world_size: int
    files: dict[str, FileEntry]
    created_unix: float = dataclasses.field(default_factory=time.time)
    tensor_bytes: int = 0
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = FORMAT_VERSION
    run_id: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "tensor_bytes": self.tensor_bytes,
            "stats": self.stats,
            "extra": self.extra,
        }
        if self.run_id is not None:  # absent, not null: manifests without a run stay as before
            body["run_id"] = self.run_id
        body["files"] = {name: dataclasses.asdict(entry) for name, entry in sorted(self.files.items())}
        return json.dumps(body, indent=1, sort_keys=False, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> Manifest:
        """Parse and type-check a manifest: :class:`CorruptCheckpointError` for anything
        wrong, :class:`UnsupportedFormatError` only for a well-formed newer version."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise _corrupt(f"manifest is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed", path)
        # Before json.loads builds anything: every entry our writer makes has this literal
        # key once (a string value cannot hold it: its quotes would be escaped). A key spelt
        # with \u escapes passes here and is counted after the parse, before validation.
        _check_entry_count(data.count(b'"crc32c"'), path)
        try:
            body = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise _corrupt(f"manifest is not valid JSON ({err})", path) from err
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(
                f"manifest does not declare format {FORMAT_NAME!r}",
                path=path,
                hint="This directory was not written by lightning_preempt.",
            )
        raw_version = body.get("version")
        version = raw_version if isinstance(raw_version, int) and not isinstance(raw_version, bool) else 0
        if version < 1:
            # Only a well-formed larger number means "newer": 0, "1", "garbage" mean damage.
            raise _corrupt(f"manifest version {raw_version!r} is not a positive integer", path)
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"manifest format version {version!r} is not supported (this build reads up to {FORMAT_VERSION})",
                path=path,
                hint="Upgrade lightning_preempt to the version that wrote this checkpoint.",
            )
        unknown = sorted(set(body) - _KNOWN_KEYS)
        if unknown:
            raise _corrupt(f"manifest has unknown field(s) {', '.join(map(repr, unknown[:5]))}", path)
        if isinstance(body.get("files"), dict):
            _check_entry_count(len(body["files"]), path)
        try:
            return cls(
                step=_int_field(body, "step", -1),
                epoch=_int_field(body, "epoch", -1),
                world_size=_int_field(body, "world_size", 1),
                files=_files_field(body["files"]),
                created_unix=_time_field(body["created_unix"], "created_unix"),
                tensor_bytes=_int_field(body, "tensor_bytes", 0, default=0),
                stats=_stats_field(body.get("stats", {})),
                extra=_dict_field(body.get("extra", {}), "extra"),
                version=version,
                run_id=_run_id_field(body.get("run_id")),
            )
        except (KeyError, TypeError, ValueError) as err:
            what = f"field {err.args[0]!r} is missing" if isinstance(err, KeyError) else str(err)
            raise _corrupt(f"manifest is missing or has a malformed field: {what}", path) from err


def parse_manifest(data: bytes, *, path: str) -> Manifest:
    """:meth:`Manifest.from_json`, and every listed file named as this package names its files
    (nothing else is ever read, copied or trusted): how manifests read from storage are parsed."""
    manifest = Manifest.from_json(data, path=path)
    bad = sorted(name for name in manifest.files if not is_checkpoint_file(name))
    if bad:
        raise _corrupt(
            f"manifest lists {len(bad)} file name(s) this package never writes (e.g. {bad[0]!r})",
            path,
        )
    return manifest


def declares_our_format(data: bytes) -> bool:
    """Whether ``data`` is a JSON object declaring this package's format: a manifest of ours
    (maybe damaged otherwise), not a user's own ``manifest.json`` (catalog/ownership.py)."""
    if len(data) > MAX_MANIFEST_BYTES:
        return False
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(body, dict) and body.get("format") == FORMAT_NAME


def _corrupt(message: str, path: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(message, path=path, hint=_DAMAGED_HINT)


def _check_entry_count(count: int, path: str) -> None:
    if count > MAX_MANIFEST_FILES:
        raise CorruptCheckpointError(
            f"manifest lists more than {MAX_MANIFEST_FILES} files ({count} found); refusing to parse it",
            path=path,
            hint=f"A checkpoint of this package lists at most {MAX_MANIFEST_FILES} files (a shard per writer "
            "thread and a state file per rank): this manifest is damaged or was not written by "
            "lightning_preempt; delete it or resume from an older checkpoint.",
        )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(body: dict[str, Any], key: str, minimum: int, *, default: int | None = None) -> int:
    value = body.get(key, default) if default is not None else body[key]
    if not _is_int(value) or not minimum <= value <= _MAX_INT:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _time_field(value: object, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= float(value) <= _MAX_UNIX:
        raise ValueError(f"{key} must be a finite time in seconds since 1970 (up to year 9999), got {value!r}")
    return float(value)


def _stats_field(value: object) -> dict[str, float]:
    stats = _dict_field(value, "stats")
    out = {}
    for k, v in stats.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or abs(v) > 1e18:
            raise ValueError(f"stats[{k!r}] must be a finite number, got {v!r}")
        out[str(k)] = float(v)
    return out


def _dict_field(value: object, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object, got {type(value).__name__}")
    return dict(value)


def _files_field(value: object) -> dict[str, FileEntry]:
    files = _dict_field(value, "files")
    out = {}
    for name, entry in files.items():
        if not is_safe_file_name(name):
            raise ValueError(f"file name {name!r} is not a plain file name")
        if not isinstance(entry, dict) or set(entry) != {"size", "crc32c"}:
            raise ValueError(f"files[{name!r}] must be an object with exactly size and crc32c")
        size, crc = entry["size"], entry["crc32c"]
        if not _is_int(size) or not 0 <= size <= _MAX_INT:
            raise ValueError(f"files[{name!r}].size must be a non-negative integer, got {size!r}")
        if not isinstance(crc, str) or not _CRC_RE.fullmatch(crc):
            raise ValueError(f"files[{name!r}].crc32c must be 8 lowercase hex digits, got {crc!r}")
        out[name] = FileEntry(size, crc)
    return out


def _run_id_field(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_RUN_ID or not value.isprintable():
        raise ValueError(f"run_id must be a printable string of 1-{_MAX_RUN_ID} characters, got {value!r}")
    return value


# ---- where a committed checkpoint's files live: beside its manifest, or in the generation ------
# directory its manifest names (a checkpoint replaced at the same path, see write/replace.py)
#: The manifest ``extra`` key naming the generation directory that holds the files.
DATA_DIR_KEY = "data_dir"


def generation_of(manifest: Manifest, *, path: str) -> str | None:
    """The generation directory ``manifest`` names, or ``None`` (files are beside it)."""
    value = manifest.extra.get(DATA_DIR_KEY)
    if value is None:
        return None
    if not isinstance(value, str) or not is_generation(value):
        # Never follow an arbitrary path out of the checkpoint (``../..``).
        raise _corrupt(f"manifest names an invalid data directory {value!r}", path)
    return value


def data_store(store: Store, manifest: Manifest) -> Store:
    """The store under which the files ``manifest`` lists live: ``store`` itself or its
    live generation directory. Every reader of a checkpoint's files resolves them here."""
    generation = generation_of(manifest, path=store.url)
    return store.child(generation) if generation else store

