"""Every name this package gives a file or directory, and how to recognise one: the only
module that spells a name or a pattern, so the writer, the readers, retention, the drain, the
peer replica and the ownership check agree on what is ours (the map: docs/design.md,
"Checkpoint layout").
"""

from __future__ import annotations

import re
import uuid

MANIFEST_NAME = "manifest.json"
DCP_METADATA_NAME = ".metadata"
#: A zero-byte object that makes a checkpoint path exist on object stores before its commit.
MARKER_NAME = ".lightning_preempt"
#: Created create-only by the one save that writes its files directly into a checkpoint
#: path; a concurrent save to the same path finds it and writes a generation of its own.
CLAIM_NAME = ".lightning_preempt.writer"
#: A tier-0 copy's seal (read/seal.py), and its temporary name while written.
SEAL_NAME = ".lightning_preempt.seal"
_SEAL_RE = re.compile(r"\.lightning_preempt\.seal(?:\.[0-9a-f]{8}\.tmp)?")
#: Every name this package gives an entry directly under a checkpoint root starts with it,
#: except the checkpoints themselves.
HIDDEN_PREFIX = ".lp-"
LEASE_PREFIX = ".lp-lease-"
PROBE_PREFIX = ".lp-probe-"
#: The goodput ledger's directory under a checkpoint root (format/ledger_records.py).
LEDGER_DIR = ".lp-ledger"

SHARD_RE = re.compile(r"__(\d{1,6})_\d{1,9}\.distcp")
STATE_RE = re.compile(r"state-rank(\d{5,6})\.pt")
#: DeepSpeed's own per-rank files in a checkpoint directory (lightning/deepspeed.py): ZeRO's
#: ``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp}_{model,optim}_states.pt``, the model states of
#: ZeRO 1-2 ``mp_rank_{mp}_model_states.pt``.
DEEPSPEED_FILE_RE = re.compile(
    r"(?:(?:bf16_)?zero_pp_rank_(\d{1,6})_)?mp_rank_\d{2,6}_(?:model|optim)_states\.pt"
)
GENERATION_RE = re.compile(r"v-[0-9a-f]{12}")
STEP_DIR_RE = re.compile(r"step-(\d{10,19})(?:-[0-9a-f]{8})?")
LEASE_RE = re.compile(r"\.lp-lease-(\d{10})\.json")
#: A ledger run directory: the run id (uuid4 hex, or what an older run wrote).
LEDGER_RUN_RE = re.compile(r"[0-9A-Za-z_-]{1,64}")
#: One ledger record (restart, sequence number, kind) or a compacted file (restart, seq range).
LEDGER_RECORD_RE = re.compile(r"r(\d{5})-(\d{6})-([a-z]{1,12})\.json")
LEDGER_COMPACT_RE = re.compile(r"r(\d{5})-c(\d{6})-(\d{6})\.json")
#: What a killed save or commit leaves in a checkpoint directory: a temporary manifest or claim, DCP
#: output of any name (the extension is DCP's own), DCP's own temporary metadata.
_COMMIT_TMP_RE = re.compile(r"\.(?:manifest\.json|\.lightning_preempt\.writer)\.[0-9a-f]+\.tmp")
_LEFTOVER_RE = re.compile(rf"{_COMMIT_TMP_RE.pattern}|[^/]+\.distcp|\.metadata\.tmp")
#: A step number in a name this package did not give (``epoch=0-step=100.ckpt``).
_FOREIGN_STEP_RE = re.compile(r"(?:^|[-_=])step[=_-]?(\d+)")


# ---- checkpoint files --------------------------------------------------------------------
def state_file(rank: int) -> str:
    """The name of ``rank``'s non-tensor state file."""
    return f"state-rank{rank:05d}.pt"


def is_checkpoint_file(name: str) -> bool:
    """A file a manifest may list: DCP's shards and metadata, a rank's state file, or one of
    DeepSpeed's per-rank files."""
    return (
        name == DCP_METADATA_NAME
        or SHARD_RE.fullmatch(name) is not None
        or STATE_RE.fullmatch(name) is not None
        or DEEPSPEED_FILE_RE.fullmatch(name) is not None
    )


def is_our_file(name: str) -> bool:
    """A file this package writes directly in a checkpoint directory (listed in the
    manifest or not: the manifest itself, the marker, what a killed save leaves)."""
    return (
        name in (MANIFEST_NAME, MARKER_NAME, CLAIM_NAME)
        or is_checkpoint_file(name)
        or _LEFTOVER_RE.fullmatch(name) is not None
        or _SEAL_RE.fullmatch(name) is not None
    )


def is_commit_temp(name: str) -> bool:
    """A local commit's temporary manifest or claim: in flight while its writer commits (it
    deletes it itself), so a concurrent save's clean-up must leave it."""
    return _COMMIT_TMP_RE.fullmatch(name) is not None


def writer_of(name: str) -> int:
    """The rank that writes ``name`` into a checkpoint (rank 0 for ``.metadata``)."""
    match = SHARD_RE.fullmatch(name) or STATE_RE.fullmatch(name) or DEEPSPEED_FILE_RE.fullmatch(name)
    return int(match.group(1)) if match and match.group(1) else 0


def is_safe_file_name(name: object) -> bool:
    """A single path component that cannot leave its directory (no ``/``, ``..``, NUL…)."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and not any(c in name for c in "/\\\x00")
        and name.isprintable()
    )


# ---- generations (a checkpoint replaced at its path) -----------------------------------------
def new_generation() -> str:
    return f"v-{uuid.uuid4().hex[:12]}"


def is_generation(name: str) -> bool:
    return GENERATION_RE.fullmatch(name) is not None


# ---- checkpoint directories under a root ---------------------------------------------------
def checkpoint_name(step: int, suffix: str | None = None) -> str:
    """The directory name the callback gives the checkpoint of ``step`` (``suffix``: 8 hex
    digits, for a step reached again after resuming from an older checkpoint)."""
    return f"step-{step:010d}" + (f"-{suffix}" if suffix else "")


def dir_step(name: str) -> int | None:
    """The step in one of our checkpoint directory names, or ``None`` for any other name."""
    match = STEP_DIR_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def foreign_step(name: str) -> int | None:
    """The step a name this package did not give carries (``epoch=0-step=100.ckpt``), if any."""
    match = _FOREIGN_STEP_RE.search(name)
    return int(match.group(1)) if match else None


#: The highest lease generation a name can carry (:data:`LEASE_RE`: exactly 10 digits). A
#: name with more digits would be invisible to every reader of the lease.
LEASE_GENERATION_MAX = 10**10 - 1


def lease_name(generation: int) -> str:
    """The file name of lease ``generation`` (1 … :data:`LEASE_GENERATION_MAX`)."""
    if not 1 <= generation <= LEASE_GENERATION_MAX:
        raise ValueError(f"lease generation {generation} is outside 1..{LEASE_GENERATION_MAX}")
    return f"{LEASE_PREFIX}{generation:010d}.json"


def lease_generation(name: str) -> int | None:
    match = LEASE_RE.fullmatch(name)
    return int(match.group(1)) if match else None


# ---- a change of kind at a path (local disk) ------------------------------------------------
def sibling_name(base: str, kind: str) -> str:
    """``.{base}.lp-{kind}-{12 hex}``: where a file or directory waits beside ``base``."""
    return f".{base}.lp-{kind}-{uuid.uuid4().hex[:12]}"


def is_sibling_of(name: str, base: str) -> bool:
    """Whether ``name`` is a :func:`sibling_name` of ``base`` (``new`` or ``old``)."""
    return re.fullmatch(re.escape(f".{base}.lp-") + r"(new|old)-[0-9a-f]{12}", name) is not None


# ---- the goodput ledger ------------------------------------------------------------------------
def ledger_record_name(restart: int, seq: int, kind: str) -> str:
    """``r00003-000017-save.json``: record ``seq`` of restart ``restart`` of a run."""
    return f"r{restart:05d}-{seq:06d}-{kind}.json"


def ledger_compact_name(restart: int, first: int, last: int) -> str:
    """``r00003-c000000-000255.json``: records ``first``..``last`` of a restart, compacted."""
    return f"r{restart:05d}-c{first:06d}-{last:06d}.json"
