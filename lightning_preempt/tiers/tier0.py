"""Tier 0: checkpoints in node-local shared memory (``/dev/shm``), the policy pieces.

Tier 0 is meant as *one more tier* in the usual format (DCP shards, per-rank state files,
``manifest.json`` committed last with CRC32C): a directory tree under a tmpfs that
outlives the training process, so commit, verification and the newest-valid choice are
the code every other tier uses (catalog/newest.py). This module holds what is specific
to it and needs no process group: where it lives, how often it is written (K, from the
measured copy and step times), which of its checkpoints retention keeps, and which steps
a rank holds there (for ``Engine.held_steps``).

Layout (one tmpfs directory per run, one per node)::

    /dev/shm/lightning_preempt/<run-id>/step-NNNNNNNNNN/   this node's ranks' files + manifest
                                                            (+ the previous node's, several nodes)

The engine writes it (engine/engine.py ``save_memory``: a save to a path outside the other
tiers goes straight there) and the resolver reads it as one more candidate
(resume/resolver.py); docs/tier0.md. On several nodes each copy also goes to the next
node's ``step-N`` (engine/memory_tier.py, tiers/tier0_peer.py).
"""

from __future__ import annotations

import hashlib
import math
import os
import re

from lightning_preempt.catalog.listing import list_checkpoints

#: The tmpfs directory tier 0 lives under (one sub-directory per run).
DEFAULT_TIER0_BASE = "/dev/shm/lightning_preempt"
#: The step-time overhead tier 0 may cost, as a fraction of the step time.
MAX_OVERHEAD = 0.01
#: Tier-0 checkpoints kept per node (memory is the scarce resource here).
KEEP_LAST_N = 2

_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def tier0_root(run_id: str, base: str = DEFAULT_TIER0_BASE) -> str:
    """The directory of ``run_id``'s tier-0 checkpoints under ``base``."""
    if not _RUN_ID.match(run_id) or run_id in (".", ".."):
        raise ValueError(f"run id {run_id!r} cannot name a tier-0 directory\n"
                         "HINT: use letters, digits, '_', '-' or '.' (the engine's run ids are hex).")  # fmt: skip
    return os.path.join(base.rstrip("/") or "/", run_id)


def default_memory_root(dirpath: str, base: str = DEFAULT_TIER0_BASE) -> str:
    """Tier 0's directory for the checkpoints of ``dirpath``: ``<base>/<name>-<hash>``, the
    same on every restart of the job (the run id is known only after the resume choice)."""
    tail = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(dirpath.rstrip("/")))[:48].strip(".") or "run"
    digest = hashlib.sha256(dirpath.rstrip("/").encode()).hexdigest()[:12]
    return tier0_root(f"{tail}-{digest}", base)


def choose_every(copy_s: float, step_s: float, max_overhead: float = MAX_OVERHEAD) -> int:
    """K: copy tier 0 every K steps so that one copy of ``copy_s`` seconds costs at most
    ``max_overhead`` of the K steps' time (``step_s`` each). At least 1."""
    if not (copy_s >= 0 and step_s > 0 and 0 < max_overhead <= 1):
        raise ValueError(f"cannot choose K from copy {copy_s}s, step {step_s}s, overhead {max_overhead}\n"
                         "HINT: pass measured, positive times and an overhead in (0, 1].")  # fmt: skip
    return max(1, math.ceil(copy_s / (max_overhead * step_s) - 1e-9))


class Tier0Schedule:
    """When to start a tier-0 copy: every ``every`` steps, never while the previous runs.

    ``every=None`` means "auto": :meth:`measured` sets it from the first measured copy.
    """

    def __init__(self, every: int | None = None, max_overhead: float = MAX_OVERHEAD) -> None:
        if every is not None and every < 1:
            raise ValueError(f"tier0_every_n_steps must be >= 1, got {every}\nHINT: pass None for auto.")
        self.every = every
        self.max_overhead = max_overhead
        self.busy = False

    def due(self, step: int) -> bool:
        """Whether to start a copy at ``step`` (auto: the first step copies, to measure)."""
        if self.busy:
            return False
        return self.every is None or step % self.every == 0

    def measured(self, copy_s: float, step_s: float) -> int:
        """Record a finished copy; in auto mode K is chosen from it. Returns K."""
        self.busy = False
        if self.every is None:
            self.every = choose_every(copy_s, step_s, self.max_overhead)
        return self.every


def committed_steps(root: str) -> list[int]:
    """The steps committed in the tier-0 directory ``root`` (oldest first); none when absent."""
    if not os.path.isdir(root):
        return []
    return sorted(c.step for c in list_checkpoints(root, {}) if c.committed)


def to_prune(root: str, keep: int = KEEP_LAST_N) -> list[str]:
    """The tier-0 checkpoint directories to delete: committed ones past the newest ``keep``,
    and uncommitted leftovers older than the newest committed one (a torn copy)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}\nHINT: tier 0 keeps at least its newest copy.")
    if not os.path.isdir(root):
        return []
    infos = list_checkpoints(root, {})  # newest first
    committed = [c for c in infos if c.committed]
    if not committed:
        return []
    newest = committed[0].step
    old = [c.path for c in committed[keep:]]
    torn = [c.path for c in infos if not c.committed and c.step < newest]
    return sorted(old + torn)
