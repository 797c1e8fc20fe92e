"""Tier 0: checkpoints in node-local shared memory (``/dev/shm``), the policy pieces.

Tier 0 is meant as *one more tier* in the usual format (DCP shards, per-rank state files,
``manifest.json`` committed last with CRC32C): a directory tree under a tmpfs that
outlives the training process, so commit, verification and the newest-valid choice are
the code every other tier uses (catalog/newest.py). This module holds what is specific
to it and needs no process group: where it lives, how often it is written (K, from the
measured copy and step times), how many copies retention keeps (:data:`KEEP_LAST_N`), and which steps
a rank holds there (for ``Engine.held_steps``).

Layout (one tmpfs directory per run, one per node)::

    /dev/shm/lightning_preempt-<uid>/<name>-<hash>/step-NNNNNNNNNN/   this node's ranks' files
                                                            + manifest (+ the previous node's)

Each user has a base of their own, 0700, and every directory of it is made and checked by
storage/private.py (never a symlink, another uid's or a group/other-writable one). The run
directory holds :data:`IDENTITY_FILE`: the (dirpath, run id) pairs that wrote copies there;
the resolver takes a copy only if its manifest's run id is one of this dirpath's.

The engine writes it (engine/engine.py ``save_memory``: a save to a path outside the other
tiers goes straight there) and the resolver reads it as one more candidate
(resume/resolver.py); docs/tier0.md. On several nodes each copy also goes to the next
node's ``step-N`` (engine/memory_tier.py, tiers/tier0_peer.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.storage.private import read_private, user_base, write_private

#: The shared tmpfs each user's tier-0 base lives in (``lightning_preempt-<uid>``, 0700).
DEFAULT_TIER0_PARENT = "/dev/shm"
#: The run directory's identity: which (dirpath, run id) pairs wrote its copies.
IDENTITY_FILE = ".lp-tier0-run.json"
#: Pairs remembered (a resumed run keeps its id: one pair per job, more only when shared).
IDENTITY_KEPT = 32
#: The step-time overhead tier 0 may cost, as a fraction of the step time.
MAX_OVERHEAD = 0.01
#: Tier-0 checkpoints kept per node (memory is the scarce resource here). One is enough: the
#: next copy is written beside it and it is removed only once that one committed, so a copy
#: torn by a kill leaves the previous one (and the disk tiers stay the fallback for damage).
#: The tmpfs then holds one copy, two while a copy is written (docs/tier0.md has the figures).
KEEP_LAST_N = 1

#: What to do when a tier-0 copy cannot be made (engine/memory_tier.py logs it).
MEMORY_HINT = (
    "Tier 0 is best effort: the disk tiers hold the periodic checkpoints. Free memory in the "
    "tmpfs (df -h /dev/shm; a container's /dev/shm is often 64 MiB: docker --shm-size), make "
    "tier0_every_n_steps larger, or point memory_dirpath at a bigger tmpfs (docs/tier0.md)."
)

_RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def tier0_root(run_id: str, base: str | None = None) -> str:
    """The directory of ``run_id``'s tier-0 checkpoints under ``base``."""
    if not _RUN_ID.match(run_id) or run_id in (".", ".."):
        raise ValueError(f"run id {run_id!r} cannot name a tier-0 directory\n"
                         "HINT: use letters, digits, '_', '-' or '.' (the engine's run ids are hex).")  # fmt: skip
    base = user_base(DEFAULT_TIER0_PARENT) if base is None else base
    return os.path.join(base.rstrip("/") or "/", run_id)


def default_memory_root(dirpath: str, base: str | None = None) -> str:
    """Tier 0's directory for the checkpoints of ``dirpath``: ``<base>/<name>-<hash>``, the
    same on every restart of the job (the run id is known only after the resume choice).
    ``base``: this user's own, ``/dev/shm/lightning_preempt-<uid>`` by default."""
    tail = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(dirpath.rstrip("/")))[:48].strip(".") or "run"
    digest = hashlib.sha256(dirpath.rstrip("/").encode()).hexdigest()[:12]
    return tier0_root(f"{tail}-{digest}", base)


def own_components(root: str) -> int:
    """How many trailing components of ``root`` tier 0 owns (storage/private.py): 2 under a
    per-user base (the base and the run directory), else 1 (a ``memory_dirpath`` given)."""
    return 2 if os.path.basename(os.path.dirname(root.rstrip("/"))) == os.path.basename(user_base()) else 1


def is_default_root(root: str) -> bool:
    """Whether ``root`` is one :func:`default_memory_root` names (a refusal then turns tier 0
    off with a warning; a ``memory_dirpath`` the user gave is an error instead)."""
    return own_components(root) == 2


def identity(root: str) -> list[list[str]]:
    """The (dirpath, run id) pairs that wrote copies in ``root`` (none: absent, unreadable,
    not a private file of this uid)."""
    try:
        runs = json.loads(read_private(os.path.join(root, IDENTITY_FILE), max_bytes=64 << 10))["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(runs, list):
        return []
    return [r for r in runs if isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)]


def claim(root: str, dirpath: str, run_id: str) -> None:
    """Record that ``run_id`` of ``dirpath`` writes copies in ``root`` (0600, replaced whole:
    storage/private.py), before its first copy. Raises ``OSError``."""
    pair = [dirpath.rstrip("/") or dirpath, run_id]
    runs = [*[r for r in identity(root) if r != pair][-(IDENTITY_KEPT - 1):], pair]
    write_private(os.path.join(root, IDENTITY_FILE), json.dumps({"version": 1, "runs": runs}).encode())


def whose(root: str, dirpath: str) -> set[str]:
    """The run ids of ``dirpath`` that wrote copies in ``root``: a copy of any other run is
    not this job's (another job sharing ``memory_dirpath``, a copy put there by hand)."""
    key = dirpath.rstrip("/") or dirpath
    return {run for d, run in identity(root) if d == key}


def choose_every(copy_s: float, step_s: float, max_overhead: float = MAX_OVERHEAD) -> int:
    """K: copy tier 0 every K steps so that one copy of ``copy_s`` seconds costs at most
    ``max_overhead`` of the K steps' time (``step_s`` each). At least 1."""
    if not (copy_s >= 0 and step_s > 0 and 0 < max_overhead <= 1):
        raise ValueError(f"cannot choose K from copy {copy_s}s, step {step_s}s, overhead {max_overhead}\n"
                         "HINT: pass measured, positive times and an overhead in (0, 1].")  # fmt: skip
    return max(1, math.ceil(copy_s / (max_overhead * step_s) - 1e-9))


#: Steps measured before auto's first copy (the base step time it is weighed against).
WARMUP_STEPS = 5
#: Recent quiet step times (no save or copy in flight) the base step time is the mean of.
STEP_WINDOW = 50
#: Recent copies whose measured cost auto weighs (the median: one noisy window moves nothing).
COST_WINDOW = 5


class AutoEvery:
    """``tier0_every_n_steps="auto"`` on one rank: K from the measured step-time overhead.

    Fed at every optimizer-step boundary (:meth:`boundary`) and when a copy starts and is
    done; :meth:`ready` is this rank's vote. Ranks agree on the votes at the existing
    flag exchange (preemption/schedule.py, MAX), so a copy starts only at a boundary where
    *every* rank is ready: each one's previous copy finished and K of its steps passed
    since it started (K is each rank's own; the slowest rank's wins). No collective of its own.

    Cost of a copy = what the steps it overlapped took beyond the base step time (the mean of
    recent quiet steps), at least the time training blocked on it: so the writer thread's
    competition for the CPU counts too, not only the staging copy. K = the smallest that keeps
    that cost within ``max_overhead`` of K steps, and at least the copy's whole duration in
    steps (never more often than the previous copy finished). Re-evaluated after every copy,
    from the median of the last :data:`COST_WINDOW` costs. The first copy is due once
    :data:`WARMUP_STEPS` quiet steps were measured; it pays the one-time set-up (the staging
    buffers), so the second follows as soon as the first's duration allows and is the first
    measurement.
    """

    def __init__(self, max_overhead: float = MAX_OVERHEAD) -> None:
        if not 0 < max_overhead <= 1:
            raise ValueError(f"max_overhead must be in (0, 1], got {max_overhead}\nHINT: 0.01 keeps tier 0 within 1 %.")
        self.max_overhead = max_overhead
        self.every: int | None = None  # K, once a copy was measured
        self.costs: list[tuple[float, float]] = []  # (overhead s, whole copy s) of recent copies
        self._quiet: list[float] = []  # recent step times with nothing in flight
        self._last: float | None = None  # the previous boundary's time
        self._started: int | None = None  # the step the newest copy started at
        self._open = False  # a copy is in flight: its window collects excess step time
        self._excess = 0.0
        self._dirty = False  # another save overlapped the window: its excess is not this copy's
        self._first = True  # the next copy to finish is the first: set-up, not a measurement
        self.copy_steps: int | None = None  # the copy's whole duration in steps (median of recent)
        self._carried = False  # every and copy_steps came from a previous launch (resume)

    def resume(self, every: int, copy_steps: int) -> None:
        """Start from a previous launch's schedule (engine/loss_bound.py ``read_schedule``): the
        bound holds from this launch's first step, and its first copy (set-up) replaces nothing."""
        self.every, self.copy_steps, self._carried = max(1, every), max(1, copy_steps), True

    @property
    def step_s(self) -> float | None:
        """The base step time (mean of recent quiet steps), once enough were measured."""
        return sum(self._quiet) / len(self._quiet) if len(self._quiet) >= WARMUP_STEPS else None

    def boundary(self, now: float, *, other_save: bool = False) -> None:
        """An optimizer-step boundary at ``now`` (monotonic seconds). ``other_save``: a save
        that is not a tier-0 copy was in flight during the step just ended."""
        gap, self._last = (now - self._last if self._last is not None else None), now
        if gap is None:
            return
        if self._open:
            base = self.step_s
            self._excess += gap - base if base is not None else 0.0
            self._dirty |= other_save
        elif not other_save:
            self._quiet = [*self._quiet, gap][-STEP_WINDOW:]

    def started(self, step: int) -> None:
        """A tier-0 copy started at ``step`` (every rank, at the same agreed boundary)."""
        self._started, self._open, self._excess, self._dirty = step, True, 0.0, False

    @property
    def in_flight(self) -> bool:
        return self._open

    def finished(self, *, blocking_s: float, copy_s: float) -> int | None:
        """The copy in flight committed (or failed) after ``copy_s`` seconds, ``blocking_s`` of
        them on the training thread. Returns the new K (``None``: nothing measured yet)."""
        if not self._open:
            return self.every
        self._open = False
        base = self.step_s
        if base is None:
            return self.every
        whole_steps = max(1, math.ceil(copy_s / base - 1e-9))
        if self._first:
            # The first copy pays the one-time set-up (the staging buffers' first touch: up to
            # seconds) that no later copy pays: not a measurement. The next copy comes as soon
            # as this one's duration allows and measures.
            self._first = False
            if not self._carried:
                self.every = self.copy_steps = whole_steps
            return self.every
        cost = blocking_s if self._dirty else max(blocking_s, self._excess)
        self.costs = [*self.costs, (max(0.0, cost), max(0.0, copy_s))][-COST_WINDOW:]
        overhead = sorted(c for c, _ in self.costs)[len(self.costs) // 2]
        whole = sorted(w for _, w in self.costs)[len(self.costs) // 2]
        self.copy_steps = max(1, math.ceil(whole / base - 1e-9))
        self.every = max(choose_every(overhead, base, self.max_overhead), self.copy_steps)
        return self.every

    def ready(self, step: int) -> bool:
        """This rank's vote at ``step``: its previous copy is done and K steps passed since it
        started (before the first copy: once the base step time is measured)."""
        if self._open or self.step_s is None:
            return False
        if self._started is None or self.every is None:
            return self._started is None  # the first copy; a measurement still missing waits
        return step - self._started >= self.every


def committed_steps(root: str) -> list[int]:
    """The steps committed in the tier-0 directory ``root`` (oldest first); none when absent."""
    return sorted(c.step for c in list_checkpoints(root, {}) if c.committed)
