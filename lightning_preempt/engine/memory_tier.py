"""The engine's tier-0 decisions (docs/tier0.md): when to copy to host memory, where, and
what of it to keep.

Tier 0 is one more tier in the usual format under a tmpfs (``memory_dirpath``, default
``/dev/shm/lightning_preempt/<dirpath's name>-<hash>``): a save addressed there is written
and committed straight there by the plugin (manifest last, CRC32C), so the resolver's
newest-valid choice reads it like any tier and never resumes from a torn copy. The policy
pieces (root, retention, held steps) are in tiers/tier0.py.

Limit (this cut): tier 0 is written and resumed from only when every rank runs on one host;
a copy spread over several nodes' memory could not be restored without the peer copy
(not built), so on several hosts it is turned off with a warning.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Literal

from lightning_preempt.catalog.retention import retain
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name
from lightning_preempt.save.history import SaveRecord
from lightning_preempt.save.saver import Saver
from lightning_preempt.tiers.tier0 import KEEP_LAST_N, AutoEvery, committed_steps

log = logging.getLogger(__name__)

MEMORY_HINT = (
    "Tier 0 is best effort: the disk tiers hold the periodic checkpoints. Free memory in the "
    "tmpfs (df -h /dev/shm; a container's /dev/shm is often 64 MiB: docker --shm-size), make "
    "tier0_every_n_steps larger, or point memory_dirpath at a bigger tmpfs (docs/tier0.md)."
)


class MemoryTier:
    """Tier 0 of one engine: copy every ``every`` steps to ``root`` (``"auto"``: K from the
    measured overhead, tiers/tier0.py ``AutoEvery``), keep the newest ``keep``."""

    def __init__(self, root: str, every: int | Literal["auto"], keep: int = KEEP_LAST_N) -> None:
        self.root = root
        self.auto = AutoEvery() if every == "auto" else None
        self.every = every if isinstance(every, int) else None  # auto: known once a copy is measured
        self.keep = keep
        self.enabled = False  # set up, and every rank on this host
        self.in_flight: str | None = None  # the copy the saver may still be writing
        self._measuring: SaveRecord | None = None  # auto: the copy whose cost is being measured
        self.copies = 0  # copies started: the same count on every rank (they start at agreed steps)

    def setup(self, group: pdist.ProcessGroup | None, *, leader: bool) -> bool:
        """Collective: on only when every rank runs on this host and could create ``root``
        (every rank decides alike). Returns whether it is on."""
        try:
            os.makedirs(self.root, exist_ok=True)
            made = ""
        except OSError as err:
            made = f"{type(err).__name__}: {err}"
        views = pdist.all_gather_objects((socket.gethostname(), made), group)
        hosts = {host for host, _ in views}
        errors = [why for _, why in views if why]
        self.enabled = len(hosts) == 1 and not errors
        if not self.enabled and leader:
            reason = f"the ranks run on {len(hosts)} hosts" if len(hosts) > 1 else f"cannot create it ({errors[0]})"
            log.warning(
                "lightning_preempt: tier 0 (memory_dirpath=%s) is off: %s\n"
                "HINT: tier 0 restores only when one node holds every rank's share (the copy to a "
                "peer node is not built yet) in a writable tmpfs; the disk tiers are unchanged (docs/tier0.md).",
                self.root, reason,
            )  # fmt: skip
        return self.enabled

    def due(self, step: int) -> bool:
        """A fixed K: whether ``step`` copies (every rank counts alike; auto votes instead)."""
        return self.enabled and self.every is not None and self.auto is None and step > 0 and step % self.every == 0

    def vote(self, step: int, saver: Saver) -> int:
        """Auto K, at every optimizer-step boundary: feed this rank's measurements to the
        policy and return its vote for the agreement (preemption/schedule.py ``tier0``, MAX):
        ``3 * copies + 1`` ready, ``+ 2`` not ready; 0 without auto tier 0. Every rank votes
        with the same ``copies``, so the MAX says "every rank ready" only as ``+ 1``; and an
        overlapped exchange read after a copy started (votes cast before it) carries an older
        count, which :meth:`agreed` refuses alike on every rank. Cheap: reads the saver's records."""
        auto = self.auto
        if auto is None or not self.enabled:
            return 0
        newest = saver.history[-1] if saver.history else None
        busy = newest is not None and newest.committed_s is None and newest.error is None
        auto.boundary(time.monotonic(), other_save=busy and newest is not self._measuring)
        rec = self._measuring
        if auto.in_flight and (rec is None or rec.committed_s is not None or rec.error is not None):
            # done (or this rank wrote nothing: a strategy where another rank writes)
            copy_s = 0.0 if rec is None else rec.committed_s if rec.committed_s is not None else time.perf_counter() - rec.started
            before, self.every = self.every, auto.finished(blocking_s=rec.blocking_s if rec is not None else 0.0, copy_s=copy_s)
            self._measuring = None
            if self.every != before:
                log.info("lightning_preempt: tier 0 copies every %s steps (auto: the last copy took %.3f s, a step "
                         "%.4f s; overhead kept within 1 %%)", self.every, copy_s, auto.step_s or 0.0)  # fmt: skip
        return 3 * self.copies + (1 if auto.ready(step) else 2)

    def agreed(self, vote: int) -> bool:
        """Whether the agreed ``vote`` starts an auto copy now (the same answer on every rank)."""
        return self.auto is not None and self.enabled and vote == 3 * self.copies + 1

    def started(self, step: int, path: str, record: SaveRecord | None) -> None:
        """A copy to ``path`` started at ``step`` (``record``: the saver's record of it, if this
        rank wrote; auto measures it)."""
        self.in_flight = path
        self.copies += 1
        if self.auto is not None:
            self.auto.started(step)
            self._measuring = record

    def path(self, step: int, group: pdist.ProcessGroup | None) -> str:
        """``root/step-N``, or a suffixed sibling when ``step-N`` is committed there already (a
        resume from an older checkpoint re-reaches a step): nothing saved is overwritten."""
        path = os.path.join(self.root, checkpoint_name(step))

        def pick() -> str:
            if not os.path.exists(os.path.join(path, MANIFEST_NAME)):
                return path
            return os.path.join(self.root, checkpoint_name(step, suffix=uuid.uuid4().hex[:8]))

        return agree.decide(pick, group, what="choosing the tier-0 path")

    def queue_retention(self, saver: Saver, run_id: str | None) -> None:
        """Rank 0, behind the save just made (it runs once that save committed or failed)."""
        root, keep = self.root, self.keep
        saver.submit(lambda: retain(root, keep, {}, run_id=run_id))

    def held(self) -> list[int]:
        """The steps committed in tier 0 (for ``Engine.held_steps``: the failure verdict)."""
        return committed_steps(self.root) if self.enabled else []
