"""Which checkpoint a restarted job resumes from — decided once, for every rank.

Two phases, because Lightning asks before the process group exists: :meth:`ResumeResolver.peek`
(every rank, no collective; a listing error is retried, then remembered, never taken for
"nothing there") and :meth:`ResumeResolver.choose` / :meth:`ResumeResolver.target` (every
rank, collective: rank 0 picks the newest checkpoint that verifies, every rank gets it or the
same error). A candidate is passed over only for what it *is* (uncommitted, damaged).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_preempt.catalog.listing import CheckpointInfo, complete_local_checkpoints, list_checkpoints
from lightning_preempt.catalog.newest import first_valid, newest_valid
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointError, NotACheckpointError
from lightning_preempt.read.load import NONE_VERIFIES_HINT, Fallback
from lightning_preempt.read.verify import Verify
from lightning_preempt.storage.diagnose import describe, is_transient, storage_hint
from lightning_preempt.storage.private import PRIVATE_HINT, private_dirs
from lightning_preempt.storage.reach import StorageUnreachableError
from lightning_preempt.storage.retry import Backoff, retry
from lightning_preempt.tiers.tier0 import own_components, whose
from lightning_preempt.tiers.two_tier import TwoTier

log = logging.getLogger(__name__)

T = TypeVar("T")


class ListingError(CheckpointError):
    """``dirpath`` could not be listed (after retries): resuming is impossible to decide."""


@dataclasses.dataclass(frozen=True)
class Peek:
    """What one rank saw before the process group existed."""

    has_checkpoint: bool
    error: agree.Outcome | None = None


@dataclasses.dataclass(frozen=True)
class ResumeTarget:
    """The checkpoint every rank loads, the next one to try if the load finds it damaged, and
    what was skipped to get there."""

    path: str
    step: int
    fallback: Fallback | None = None
    run_id: str | None = None  # the run that wrote it: a resumed run continues it
    skipped: tuple[str, ...] = ()


@dataclasses.dataclass(eq=False, repr=False)
class ResumeResolver:
    """Peek, agree and choose the resume target for one ``dirpath``.

    Args:
        dirpath: the checkpoints' root (any fsspec URL).
        storage_options: fsspec options for ``dirpath``.
        local_dirpath: the node-local tier, if any.
        memory_dirpath: tier 0 (docs/tier0.md), if any: node-local host memory, one more
            candidate, used only while ``memory_usable`` (every rank's share is on rank 0's
            node, and on every other node after the engine's restore from peers).
        retries: listing attempts before giving up (>= 1).
        backoff_s: first retry delay; doubles each time.
        sleep: how to wait between attempts (tests pass a recorder).
    """

    dirpath: str
    storage_options: dict[str, Any]
    local_dirpath: str | None = None
    _: dataclasses.KW_ONLY
    memory_dirpath: str | None = None
    retries: int = 4
    backoff_s: float = 1.0
    sleep: Callable[[float], None] = time.sleep
    #: whether tier 0 can be resumed from. Before the group exists: every rank on this host
    #: by torchrun's environment; the engine sets it in set-up (engine/memory_tier.py:
    #: one shared directory, or several nodes with the peer copy and no failed restore).
    memory_usable: bool = dataclasses.field(init=False, default_factory=lambda: _one_host_by_environment())
    peeked: Peek | None = dataclasses.field(init=False, default=None)
    _refusal_told: bool = dataclasses.field(init=False, default=False)

    # ---- phase 1: before the process group ---------------------------------------------
    def peek(self) -> Peek:
        """List (with retries) and remember whether a committed checkpoint exists."""
        self.peeked = self._look()
        return self.peeked

    def _look(self) -> Peek:
        try:
            return Peek(self._retrying(self._has_checkpoint))
        except CheckpointError as err:  # remembered, never taken for "nothing there"
            return Peek(False, agree.Outcome.failure(err, pdist.rank()))

    def look_again(self, group: pdist.ProcessGroup | None, *, asked: bool) -> bool:
        """Every rank, collective, once this job holds the lease: does ``dirpath`` hold a
        committed checkpoint *now*? A job that waited for another job's lease must resume
        from what that job committed meanwhile, not keep the answer of its :meth:`peek`.
        ``asked``: the front-end peeked (``False``: it was given a checkpoint; the answer is
        then ``False``). Rank 0's view decides for every rank."""
        return agree.decide(lambda: asked and self._retrying(self._has_checkpoint), group,
                            what="listing dirpath again")  # fmt: skip

    def _has_checkpoint(self) -> bool:
        local = self.local_dirpath is not None and bool(complete_local_checkpoints(self.local_dirpath))
        root = self._memory_root()
        runs = whose(root, self.dirpath) if root is not None else set()
        memory = root is not None and any(_memory_unusable(c, None, runs) is None for c in complete_local_checkpoints(root))
        return local or memory or any(c.committed for c in list_checkpoints(self.dirpath, self.storage_options))

    def _retrying(self, fn: Callable[[], T]) -> T:
        """``fn()`` with the listing's retries; an error that persists (or is not worth
        retrying) becomes :class:`ListingError`. Damage (a :class:`CheckpointError`) is an
        answer, not a failure to look: it passes unchanged."""
        attempts = [1]

        def retrying(err: BaseException, attempt: int, delay: float) -> None:
            attempts[0] = attempt + 1
            log.warning(
                "lightning_preempt: listing %s failed (%s); attempt %d of %d, retrying in %.1fs",
                self.dirpath, describe(err, self.storage_options), attempt, self.retries, delay,
            )  # fmt: skip

        def transient(err: BaseException) -> bool:  # a missing driver, credentials, unknown host: at once
            return not isinstance(err, CheckpointError) and is_transient(err)

        try:
            return retry(lambda n: fn(), Backoff(self.retries, self.backoff_s, transient=transient, sleep=self.sleep),
                         on_retry=retrying)  # fmt: skip
        except Exception as err:  # (StorageUnreachableError: could not look, credentials, DNS: not damage)
            if isinstance(err, CheckpointError) and not isinstance(err, StorageUnreachableError):
                raise
            raise _listing_error(self.dirpath, err, attempts[0], self.storage_options) from err

    # ---- phase 2: in setup, collective ---------------------------------------------------
    def agree_on_peeks(self, group: pdist.ProcessGroup | None) -> bool:
        """Every rank: ``True`` when all ranks saw a checkpoint; the same error everywhere
        when a rank could not list, or when ranks still see different things on a second
        look together."""
        wants = self._gather(self.peeked or Peek(False), group)
        if any(wants) and not all(wants):
            # Each rank peeked on its own, before the group existed: a checkpoint committed in
            # between (the job whose lease this one waits for, finishing) reads as a split.
            # Look again, all ranks now; only a split that stays means storage not shared.
            wants = self._gather(self._look(), group)
        if any(wants) and not all(wants):
            raise NotACheckpointError(
                f"ranks disagree on whether {self.dirpath} holds a checkpoint (per rank: {wants})",
                path=self.dirpath,
                hint="dirpath must be storage that every rank sees (a shared filesystem or an object store).",
            )
        return all(wants)

    @staticmethod
    def _gather(mine: Peek, group: pdist.ProcessGroup | None) -> list[bool]:
        peeks: list[Peek] = pdist.all_gather_objects(mine, group)
        for rank, peeked in enumerate(peeks):
            if peeked.error is not None:  # made before the group existed: its rank is the index
                raise dataclasses.replace(peeked.error, rank=rank).to_error(what="listing dirpath")
        return [p.has_checkpoint for p in peeks]

    def choose(self, group: pdist.ProcessGroup | None, *, tiers: TwoTier | None, verify: Verify) -> ResumeTarget:
        """Rank 0 picks the newest valid checkpoint; every rank returns it or raises the same error.

        ``verify="sizes"`` checks manifests and file sizes only: the load then checks every
        byte once, and the target's ``fallback`` names the next candidate if it finds damage.
        """
        return agree.decide(lambda: self._pick(tiers, verify, ()), group, what="choosing the checkpoint to resume from")

    def target(self, group: pdist.ProcessGroup | None, *, tiers: TwoTier | None, verify_on_load: bool) -> ResumeTarget:
        """What every rank loads (collective): rank 0 chooses with manifests and sizes only
        when the load checks every byte (then a damaged choice falls back to the next: the
        target's ``fallback``, for ``io.alias(fallback=)``, names the next checkpoint after the
        excluded ones; rank 0 answers, the loader broadcasts its answer)."""
        verify: Verify = "sizes" if verify_on_load else False
        choice = self.choose(group, tiers=tiers, verify=verify)
        log.info("lightning_preempt: resuming from %s (step %d)%s", choice.path, choice.step,
                 f"; skipped {list(choice.skipped)}" if choice.skipped else "")  # fmt: skip

        def next_one(excluded: list[str]) -> str | None:
            if pdist.rank(group) != 0:
                return None  # only rank 0's answer is taken
            try:
                return self._pick(tiers, verify, tuple(excluded)).path
            except Exception as err:  # a broadcast follows on every rank: never raise here alone
                log.error("lightning_preempt: no older checkpoint to fall back to: %s", str(err).splitlines()[0])
                return None

        return dataclasses.replace(choice, fallback=next_one if verify_on_load else None)

    def _pick(self, tiers: TwoTier | None, verify: Verify, exclude: tuple[str, ...]) -> ResumeTarget:
        skipped: list[str] = []

        def note(info: CheckpointInfo, reason: str) -> None:
            skipped.append(f"{info.name}: {reason}")
            log.warning("lightning_preempt: skipping checkpoint %s (step %d): %s", info.path, info.step, reason)

        def newest() -> CheckpointInfo | None:
            skipped.clear()
            if tiers is not None:  # newest across both tiers; local wins a tie
                found = tiers.newest(verify=verify, on_skip=note, exclude=exclude)
            else:
                found = newest_valid(self.dirpath, self.storage_options, verify=verify, on_skip=note, exclude=exclude)
            root = self._memory_root()
            if root is None:
                return found
            # a torn or truncated copy is passed over: the usual manifest and size/CRC checks;
            # so is a copy another run wrote (its run id is not one of this dirpath's)
            complete = {c.name for c in complete_local_checkpoints(root)}
            runs = whose(root, self.dirpath)
            memory = first_valid(list_checkpoints(root, {}), {}, verify=verify, on_skip=note, exclude=exclude,
                                 usable=lambda c: _memory_unusable(c, complete, runs))  # fmt: skip
            if memory is not None and (found is None or memory.step >= found.step):
                return memory  # a tie goes to memory: nothing to read from disk
            return found

        # A candidate that cannot be judged (its manifest could not be statted or read) is
        # never skipped: skipping it would silently resume from older progress, or from none.
        info = self._retrying(newest)
        if info is None:
            raise NotACheckpointError("every checkpoint found is uncommitted or corrupt", path=self.dirpath,
                                      hint=NONE_VERIFIES_HINT)  # fmt: skip
        run_id = info.manifest.run_id if info.manifest is not None else None
        return ResumeTarget(info.path, info.step, run_id=run_id, skipped=tuple(skipped))

    def _memory_root(self) -> str | None:
        """Tier 0's directory when it can be resumed from (on, usable, present, and private
        to this uid: storage/private.py; another user's directory is never read)."""
        root = self.memory_dirpath
        if root is None or not self.memory_usable or not os.path.isdir(root):
            return None
        try:
            private_dirs(root, own=own_components(root), create=False)
        except OSError as err:
            if not self._refusal_told:  # once: the resolver looks several times
                self._refusal_told = True
                log.warning("lightning_preempt: tier 0 (%s) is not resumed from: %s\nHINT: %s", root, err, PRIVATE_HINT)
            return None
        return root


def _memory_unusable(info: CheckpointInfo, complete: set[str] | None, runs: set[str]) -> str | None:
    """Why a tier-0 copy is not resumed from (``None``: it is): another run's (its run id is
    not one this dirpath recorded there: tiers/tier0.py ``claim``), or files missing here."""
    if info.manifest is None or info.manifest.run_id not in runs:
        return "not this job's tier-0 copy (its run id is not one this dirpath recorded in the directory)"
    return None if complete is None or info.name in complete else "files missing in this node's memory tier"


def _one_host_by_environment() -> bool:
    """Whether the launcher's environment allows that every rank runs on this host (torchrun:
    ``LOCAL_WORLD_SIZE`` vs ``WORLD_SIZE``; SLURM: ``SLURM_NNODES``)."""
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    torchrun_one_host = local is None or world is None or local == world
    return torchrun_one_host and os.environ.get("SLURM_NNODES", "1").strip() in ("", "1")


def _listing_error(dirpath: str, err: BaseException, attempts: int, options: dict[str, Any]) -> ListingError:
    # What to set comes first: the error's own HINT (ours), else what its kind calls for.
    cause = err.hint if isinstance(err, CheckpointError) and err.hint else storage_hint(dirpath, err)
    return ListingError(
        f"cannot list {dirpath} after {attempts} attempt(s): {describe(err, options)}",
        path=dirpath,
        hint=f"Training did not start, so nothing was lost or deleted. {cause} Check with `lightning-preempt ls "
        f"{dirpath}`, then restart (or pass PreemptionCallback(resume=False) to start fresh on purpose).",
    )
