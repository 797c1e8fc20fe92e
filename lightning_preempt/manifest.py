"""The manifest: a versioned JSON file that makes a checkpoint exist.

A checkpoint directory without ``manifest.json`` does not exist, for resume and for
retention alike. The manifest is written last, atomically, after every rank's files
are durable; it lists every file with its size and CRC32C so corruption is detected
before any byte is handed to Lightning. No pickle: any tool can read it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from lightning_preempt.errors import CorruptCheckpointError, UnsupportedFormatError

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "lightning_preempt.checkpoint"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size in bytes and CRC32C (8 hex digits)."""

    size: int
    crc32c: str


@dataclasses.dataclass
class Manifest:
    """What a committed checkpoint holds. Serialised as JSON with ``format`` and ``version``."""

    step: int
    epoch: int
    world_size: int
    files: dict[str, FileEntry]
    created_unix: float = dataclasses.field(default_factory=time.time)
    tensor_bytes: int = 0
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "tensor_bytes": self.tensor_bytes,
            "stats": self.stats,
            "extra": self.extra,
            "files": {name: dataclasses.asdict(entry) for name, entry in sorted(self.files.items())},
        }
        return json.dumps(body, indent=1, sort_keys=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, path: str) -> Manifest:
        """Parse a manifest; a garbage or unknown-version manifest raises with a HINT."""
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptCheckpointError(
                f"manifest is not valid JSON ({err})",
                path=path,
                hint="The checkpoint is damaged; delete it or resume from an older one.",
            ) from err
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(
                f"manifest does not declare format {FORMAT_NAME!r}",
                path=path,
                hint="This directory was not written by lightning_preempt.",
            )
        version = body.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise UnsupportedFormatError(
                f"manifest format version {version!r} is not supported (this build reads up to {FORMAT_VERSION})",
                path=path,
                hint="Upgrade lightning_preempt to the version that wrote this checkpoint.",
            )
        try:
            files = {name: FileEntry(int(e["size"]), str(e["crc32c"])) for name, e in body["files"].items()}
            return cls(
                step=int(body["step"]),
                epoch=int(body["epoch"]),
                world_size=int(body["world_size"]),
                files=files,
                created_unix=float(body["created_unix"]),
                tensor_bytes=int(body.get("tensor_bytes", 0)),
                stats={str(k): float(v) for k, v in body.get("stats", {}).items()},
                extra=dict(body.get("extra", {})),
                version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptCheckpointError(
                f"manifest is missing or has a malformed field ({err!r})",
                path=path,
                hint="The checkpoint is damaged; delete it or resume from an older one.",
            ) from err
