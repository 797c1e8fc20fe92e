"""The Lightning callback: a thin set of hooks over the preemption controller, the resume
resolver and the plugin.

Policy lives in :mod:`~lightning_preempt.controller` (sources, agreement, the emergency
sequence) and :mod:`~lightning_preempt.resume` (which checkpoint to resume from); the
mechanism (staging, writing, committing, verifying) in :class:`ShardedAsyncCheckpointIO`
and below. This module maps Lightning's hooks onto them. See ``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from typing_extensions import override

from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.catalog.retention import apply_retention
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.engine import tiers as tier_policy
from lightning_preempt.engine.config import PreemptionConfig, local_dirpath_from_env
from lightning_preempt.errors import CheckpointError
from lightning_preempt.format.names import checkpoint_name
from lightning_preempt.lightning import _compat
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.lightning.exact import STATE_KEY, ExactResume
from lightning_preempt.lightning.prealloc import prepare_staging
from lightning_preempt.lightning.reporting import SaveReporter, report_resume
from lightning_preempt.lightning.strategies import install_collective_saves
from lightning_preempt.preemption.controller import Preempted, PreemptionController
from lightning_preempt.preemption.deadline import GraceCheck
from lightning_preempt.preemption.notices import make_sources, parse_names
from lightning_preempt.preemption.signals import SignalFlag
from lightning_preempt.preemption.sources import PreemptionSource
from lightning_preempt.read.verify import Verify
from lightning_preempt.resume.resolver import ResumeResolver
from lightning_preempt.save.lease import Lease
from lightning_preempt.save.preflight import check_writable
from lightning_preempt.storage.store import join_url

__all__ = ["Preempted", "PreemptionCallback"]

log = logging.getLogger(__name__)

def _quiet_resume_warnings() -> None:
    """Lightning warns about "last" checkpoints whenever an OnExceptionCheckpoint is present
    and fit() gets no ckpt_path: that is exactly our auto-resume route, so the text misleads.
    The warnings are raised inside Lightning's ``fit`` before any hook of ours runs, so no
    ``catch_warnings`` block can scope them; the filters are added when a callback is
    constructed (never at import; re-adding an identical filter replaces it)."""
    warnings.filterwarnings("ignore", message=r".*ckpt_path=None\)` was called without a model.*")
    warnings.filterwarnings("ignore", message=r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint.*")


class _Runtime:
    """What one ``fit`` holds and ``teardown`` releases (never pickled)."""

    def __init__(self) -> None:
        self.groups: list[pdist.ProcessGroup] = []
        self.agree_group: pdist.ProcessGroup | None = None
        self.lease: Lease | None = None

    def new_group(self) -> pdist.ProcessGroup | None:
        group = pdist.new_gloo_group()
        if group is not None:
            self.groups.append(group)
        return group

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        for group in self.groups:
            pdist.destroy_group(group)
        self.groups.clear()
        self.agree_group = None


class PreemptionCallback(OnExceptionCheckpoint):
    """Periodic async checkpoints, a snapshot on preemption, and resume on restart.

    Add it with :class:`ShardedAsyncCheckpointIO` to the ``Trainer``; ``trainer.fit(model)``
    then resumes from the newest valid checkpoint in ``dirpath`` on every (re)start.
    Every argument is validated here (:class:`~lightning_preempt.config.PreemptionConfig`).

    Args:
        dirpath: where checkpoints go (any fsspec URL: local path, ``gs://``, ``s3://``…).
        every_n_train_steps: save every N optimizer steps.
        every_n_seconds: save when this much wall time passed since the last save.
        keep_last_n: committed checkpoints to keep (older ones are deleted after a newer commit).
        signals: signals that mean "preempted" (SLURM can send ``SIGUSR1`` earlier).
        grace_period_s: time between the signal and SIGKILL; bounds the drain and requeue
            and is used to warn when a snapshot is projected not to fit.
        exit_code: process exit code after a preemption (143 = 128 + SIGTERM), whatever the
            snapshot did (the log says which step is safe).
        requeue: run ``scontrol requeue`` on rank 0 before exiting; ``None``: when under SLURM.
        requeue_timeout_s: the longest ``scontrol`` may take (also bounded by the grace period).
        agree_every_n_steps: how often ranks agree on the signal flag: every N optimizer steps,
            or ``"auto"``: every step while timing the first steps, then about every
            ``agree_interval_s`` (tiny steps would otherwise pay ~1 ms per step for it).
        agree_interval_s: the target time between agreements with ``"auto"``.
        overlap_agreement: run the agreement collective while the next step computes and act
            on it one step later (hides its cost; see docs/design.md).
        resume: resume from the newest valid checkpoint when ``fit`` gets no ``ckpt_path``.
        save_on_train_end: save the final step when training ends normally.
        storage_options: fsspec options for ``dirpath``.
        local_dirpath: two-tier mode (docs/two-tier.md): commit each checkpoint to this
            node-local directory first and drain it to ``dirpath`` in the background.
        list_retries: attempts to list ``dirpath`` on start before failing (never "start
            fresh" because a listing failed).
        list_backoff_s: the first retry delay (doubles per attempt).
        lease: hold a lease on ``dirpath`` so a second live job cannot write into it.
        lease_timeout_s: a lease whose heartbeat has not advanced for this long is taken over.
        probe_storage: at ``setup``, check that every rank can write and list ``dirpath``
            (and ``local_dirpath``) and fail before step 1 if not.
        sources: extra preemption sources (:class:`~lightning_preempt.sources.PreemptionSource`).
        notices: cloud preemption notices to watch (docs/notices.md): any of ``"aws"``,
            ``"gce"``, ``"azure"`` (``"aws-interruption"``: AWS without rebalance
            recommendations), or ``"auto"`` (probe which metadata server answers). Local rank
            0 of each node watches; the notice reaches every rank like a signal. ``None``: off.
        on_notice: ``"continue"``: on a notice (from ``notices`` or ``sources``), snapshot at
            the next agreed step and train on until the signal (whose snapshot then costs only
            the steps since); ``"exit"``: snapshot and exit with ``exit_code`` at once.
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int | None = None,
        every_n_seconds: float | None = None,
        keep_last_n: int = 2,
        *,
        signals: Sequence[str] = ("SIGTERM",),
        grace_period_s: float = 30.0,
        exit_code: int = 143,
        requeue: bool | None = None,
        requeue_timeout_s: float = 10.0,
        agree_every_n_steps: int | Literal["auto"] = "auto",
        agree_interval_s: float = 0.25,
        overlap_agreement: bool = True,
        resume: bool = True,
        save_on_train_end: bool = True,
        storage_options: dict[str, Any] | None = None,
        local_dirpath: str | None = None,
        list_retries: int = 4,
        list_backoff_s: float = 1.0,
        lease: bool = True,
        lease_timeout_s: float = 60.0,
        probe_storage: bool = True,
        sources: Sequence[PreemptionSource] = (),
        notices: str | Sequence[str] | None = None,
        on_notice: Literal["continue", "exit"] = "continue",
    ) -> None:
        root = str(dirpath).rstrip("/") or str(dirpath) if isinstance(dirpath, (str, os.PathLike)) else dirpath
        self.config = PreemptionConfig(
            dirpath=root,  # type: ignore[arg-type]  # validated there
            every_n_train_steps=every_n_train_steps,
            every_n_seconds=every_n_seconds,
            keep_last_n=keep_last_n,
            signals=signals,  # type: ignore[arg-type]  # resolved and validated there
            grace_period_s=grace_period_s,
            exit_code=exit_code,
            requeue=requeue,
            requeue_timeout_s=requeue_timeout_s,
            agree_every_n_steps=agree_every_n_steps,
            agree_interval_s=agree_interval_s,
            overlap_agreement=overlap_agreement,
            resume=resume,
            save_on_train_end=save_on_train_end,
            storage_options=dict(storage_options) if isinstance(storage_options, dict) else storage_options or {},
            local_dirpath=local_dirpath_from_env(local_dirpath),
            list_retries=list_retries,
            list_backoff_s=list_backoff_s,
            lease=lease,
            lease_timeout_s=lease_timeout_s,
            probe_storage=probe_storage,
        )
        _quiet_resume_warnings()
        super().__init__(dirpath=self.config.dirpath)
        self.dirpath: str = self.config.dirpath
        self.storage_options = self.config.storage_options
        self.local_dirpath = self.config.local_dirpath
        if on_notice not in ("continue", "exit"):
            raise ValueError(
                f"on_notice must be 'continue' or 'exit', got {on_notice!r}\nHINT: 'continue' snapshots and trains "
                "on until the signal; 'exit' snapshots and exits for requeue at once."
            )
        self.notices = parse_names(notices)  # validated now; built in setup, for this rank's node
        self._notice_sources: list[PreemptionSource] = []
        self.controller = PreemptionController(self.config, sources, on_notice=on_notice)
        self.resolver = ResumeResolver(
            self.dirpath,
            self.storage_options,
            self.local_dirpath,
            retries=self.config.list_retries,
            backoff_s=self.config.list_backoff_s,
        )
        self.exact = ExactResume()  # RNG, data position, metric states; `.enabled = False` turns it off
        _compat.allow_with_disabled_checkpointing(PreemptionCallback)  # Trainer(enable_checkpointing=False) works
        self.resumed_from: str | None = None
        self.run_id: str | None = None  # set in setup; recorded in every manifest of this run
        self._grace = GraceCheck(self.config.grace_period_s)
        self._reporter = SaveReporter()
        self._rt: _Runtime | None = None
        self._pointer: str | None = None
        self._last_saved_path: str | None = None
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._last_seen_step: int | None = None
        self._save_kind = "periodic"
        self._restored_state: dict[str, Any] | None = None
        #: Called on every rank as ``hook(trainer, step)`` after the emergency snapshot
        #: committed and before the drain gets the rest of the grace period (PeerReplica).
        self.snapshot_hooks: list[Any] = []

    # ---- views kept for users and tools -----------------------------------------------
    @property
    def signal_flag(self) -> SignalFlag:
        return self.controller.signal_flag

    @property
    def timeline(self) -> list[tuple[str, float]]:
        """``(event, time.monotonic())`` of the preemption sequence, in order."""
        return self.controller.timeline

    def __getstate__(self) -> dict[str, Any]:
        # Process groups, the lease thread and the resume pointer belong to one fit.
        state = self.__dict__.copy()
        state["_rt"] = None
        state["_pointer"] = None
        return state

    # ---- auto-resume -------------------------------------------------------------------
    @property
    @override
    def ckpt_path(self) -> str | None:  # type: ignore[override]
        """Read by Lightning when ``fit()`` gets no ``ckpt_path`` (see docs/design.md).

        Returns a local pointer file when ``dirpath`` holds a committed checkpoint; the
        plugin maps the pointer to the checkpoint all ranks agreed on in :meth:`setup`. A
        listing that keeps failing is remembered and raised on every rank in ``setup``.
        """
        if not self.config.resume:
            return None
        probe = self.resolver.probe()
        if not probe.has_checkpoint:
            return None
        if self._pointer is None:
            fd, self._pointer = tempfile.mkstemp(prefix="lightning_preempt-resume-", suffix=".pointer")
            with os.fdopen(fd, "w") as f:
                f.write(self.dirpath)
        return self._pointer

    @property
    def best_model_path(self) -> str:
        """Lightning's ``ckpt_path="best"`` reads this from the first checkpoint callback."""
        return ""

    @best_model_path.setter
    def best_model_path(self, value: str) -> None:
        # ddp_spawn hands the workers' best path back to the first checkpoint callback
        # (launchers/multiprocessing.py); this callback keeps no "best": ignore it.
        pass

    # ---- set-up ------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        io = self._ensure_plugin(trainer)
        rt = self._rt = _Runtime()
        writer_group = rt.new_group()
        group = rt.agree_group = rt.new_group()
        self.controller.bind(group)
        install_collective_saves(trainer.strategy, io, writer_group)
        self.local_dirpath = tier_policy.configure_tiers(
            io, dirpath=self.dirpath, local_dirpath=self.local_dirpath, keep_last_n=self.config.keep_last_n,
            new_group=rt.new_group,
        )  # fmt: skip
        # A listing that kept failing on any rank stops every rank here, before step 1.
        resuming = self.config.resume and self.resolver.agree_on_probes(group)
        if self.config.probe_storage:
            self._probe_storage(group)
        if self.config.lease:
            self._take_lease(trainer, rt)
        run_id = self._choose_resume_target(trainer, io, group) if resuming else None
        # A resumed run continues the run it resumed from; a fresh one gets a new id.
        self.run_id = io.run_id = agree.decide(lambda: run_id or uuid.uuid4().hex, group)
        if io.tiers is not None:
            io.tiers.run_id = self.run_id
        if trainer.is_global_zero:
            tier_policy.upload_local_only(io.tiers, self.dirpath)
        newest = agree.decide(self._newest_manifest, group, what="reading the newest manifest")
        self._grace.check_manifest(newest)
        self.signal_flag.clear()
        if self.notices and not self._notice_sources:  # only local rank 0 of a node watches
            self._notice_sources = make_sources(self.notices, local_rank=trainer.local_rank)
            self.controller.sources.extend(self._notice_sources)
        self.controller.start()

    def _probe_storage(self, group: pdist.ProcessGroup | None) -> None:
        """Every rank writes, lists and deletes a probe in dirpath: fail before step 1, alike.

        The local tier is probed too, but a failure there only warns: saves then go straight
        to dirpath (docs/two-tier.md), which is slower but loses nothing."""
        agree.agree(lambda: check_writable(self.dirpath, self.storage_options), group, what="probing the storage")
        local = self.local_dirpath
        if local is None:
            return
        try:
            agree.agree(lambda: check_writable(local, {}), group, what="probing the local tier")
        except CheckpointError as err:
            log.warning("lightning_preempt: %s\nSaves will be written directly to %s.", err, self.dirpath)

    def _take_lease(self, trainer: pl.Trainer, rt: _Runtime) -> None:
        """Rank 0 takes the lease on dirpath (heartbeat thread); every rank gets the outcome."""
        lease = Lease(self.dirpath, self.storage_options, timeout_s=self.config.lease_timeout_s)
        if trainer.is_global_zero:
            rt.lease = lease

        def take() -> None:
            lease.acquire()
            lease.start_heartbeat()

        agree.decide(take, rt.agree_group, what="taking the lease on dirpath")

    def _choose_resume_target(
        self, trainer: pl.Trainer, io: ShardedAsyncCheckpointIO, group: pdist.ProcessGroup | None
    ) -> str | None:
        """Rank 0 picks the newest valid checkpoint, every rank loads it; returns its run id."""
        # Manifests and sizes only: the load checks every byte once, and on damage every rank
        # moves to the next candidate together (the fallback; docs/resume-speed.md).
        verify: Verify = "sizes" if io.verify_on_load else False
        choice = self.resolver.choose(group, tiers=io.tiers, verify=verify)
        assert self._pointer is not None
        fallback = self.resolver.fallback(group, tiers=io.tiers, verify=verify) if io.verify_on_load else None
        io.alias(self._pointer, choice.path, verified=False, fallback=fallback)
        self.resumed_from = choice.path
        self._last_saved_step = choice.step
        log.info(
            "lightning_preempt: resuming from %s (step %d)%s",
            choice.path, choice.step, f"; skipped {list(choice.skipped)}" if choice.skipped else "",
        )  # fmt: skip
        return choice.run_id

    def _newest_manifest(self) -> Any:
        """For the grace projection only: a failure here is logged, never fatal."""
        try:
            newest = next((c for c in list_checkpoints(self.dirpath, self.storage_options) if c.committed), None)
        except Exception as err:
            log.warning("lightning_preempt: cannot read the newest manifest for the grace check: %s", err)
            return None
        return newest.manifest if newest is not None else None

    def _ensure_plugin(self, trainer: pl.Trainer) -> ShardedAsyncCheckpointIO:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, ShardedAsyncCheckpointIO):
            return io
        if type(io) is TorchCheckpointIO:
            log.info("lightning_preempt: installing ShardedAsyncCheckpointIO (none was configured)")
            new_io = ShardedAsyncCheckpointIO(storage_options=self.storage_options, local_dirpath=self.local_dirpath)
            trainer.strategy.checkpoint_io = new_io
            return new_io
        raise TypeError(
            f"PreemptionCallback needs ShardedAsyncCheckpointIO, but the Trainer uses {type(io).__name__}\n"
            "HINT: pass plugins=[ShardedAsyncCheckpointIO()] to the Trainer (and remove other CheckpointIO plugins)."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint: why it was taken (read back to report steps lost)."""
        notice = self.controller.notice
        return {"kind": self._save_kind, "signal": notice.source if notice is not None else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_state = dict(state_dict)

    # ---- training-time hooks -----------------------------------------------------------
    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.controller.start()  # Lightning installed its own handler just before the run stage

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.controller.start()
        # Staging buffers allocated and touched in the background now: the first (maybe the
        # emergency) save only copies. Again after the first step: optimizer state appears there.
        self._prepare_after_step = prepare_staging(trainer, self._plugin(trainer)) is not None
        self._last_save_time = time.monotonic()
        self._last_seen_step = trainer.global_step
        io = self._plugin(trainer)
        if self.resumed_from is not None and io.loaded_from not in (None, self.resumed_from):
            # the chosen checkpoint failed its check while loading: an older one was loaded
            self.resumed_from, self._last_saved_step = io.loaded_from, trainer.global_step
        if self._last_saved_step is None and trainer.global_step > 0:
            self._last_saved_step = trainer.global_step  # resumed from an explicit ckpt_path
            self._warn_about_newer_checkpoints(trainer)
        report_resume(trainer, self._restored_state)
        # The checkpoint is loaded: the pointer has served. Removed now, not at teardown,
        # which a preempted process never reaches (one file in /tmp per preemption).
        self._drop_pointer()
        # A signal that arrived during start-up or restore: nothing new to save.
        self._check_now(trainer)
        self.exact.on_train_start(trainer, pl_module)  # last: restores RNG just before the first fetch

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.exact.on_train_epoch_start(trainer)  # notes the states this epoch's data order is made from

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.exact.on_train_batch_end(trainer)
        io = self._plugin(trainer)
        self._reporter.report(trainer, io.history)
        step = trainer.global_step
        if step == self._last_seen_step:
            return  # mid gradient-accumulation: no optimizer step happened, nothing to snapshot
        self._last_seen_step = step
        if self._prepare_after_step:
            self._prepare_after_step = False
            prepare_staging(trainer, io)
        now = time.monotonic()
        every_s = self.config.every_n_seconds
        local_due = every_s is not None and now - self._last_save_time >= every_s
        decision = self.controller.at_boundary(now, save_due=local_due, stop=self._must_stop(io))
        if decision.stop:
            self._stop(trainer, io)
        if decision.preempt:
            self._emergency(trainer)
        every_n = self.config.every_n_train_steps
        if (every_n is not None and step % every_n == 0) or decision.save_due:
            self._save(trainer, kind="notice" if decision.notice_snapshot else "periodic")
            if decision.notice_snapshot:
                self._noticed(io, step)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        # Validation and the sanity check can be long: agree here too.
        self._check_now(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.controller.flush()  # every rank completes its overlapped exchange
        step = trainer.global_step
        if self.config.save_on_train_end and step != self._last_saved_step and step > 0:
            self._save(trainer, kind="final")
        self._wait_agreed(trainer)
        self._reporter.report(trainer, self._plugin(trainer).history)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.exact.on_save_checkpoint(trainer, pl_module, checkpoint)  # per-rank: RNG, data position, metrics

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.exact.load(checkpoint.get(STATE_KEY))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Unlike OnExceptionCheckpoint we save nothing here: after an arbitrary error the
        # state may be inconsistent. We only make sure committed saves are complete.
        self.controller.stop()
        # Lightning calls no `teardown` hook after an exception: release here. The plugin
        # finishes its writes and drains first (they use the groups released after it).
        with contextlib.suppress(Exception):
            self._plugin(trainer).teardown()
        self._release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.controller.stop()
        self._release()

    def _release(self) -> None:
        """Give back what this fit held: lease, process groups, the resume pointer."""
        if self._rt is not None:
            self._rt.release()
            self._rt = None
        self._drop_pointer()

    def _drop_pointer(self) -> None:
        if self._pointer is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._pointer)
            self._pointer = None

    # ---- mechanics ---------------------------------------------------------------------
    def _plugin(self, trainer: pl.Trainer) -> ShardedAsyncCheckpointIO:
        io = trainer.strategy.checkpoint_io
        assert isinstance(io, ShardedAsyncCheckpointIO)
        return io

    def _group(self) -> pdist.ProcessGroup | None:
        return self._rt.agree_group if self._rt is not None else None

    def _must_stop(self, io: ShardedAsyncCheckpointIO) -> bool:
        """This rank's reason to stop training: its save failed, or the lease was lost."""
        lease = self._rt.lease if self._rt is not None else None
        return io.pending_failed() or (lease is not None and lease.lost)

    def _stop(self, trainer: pl.Trainer, io: ShardedAsyncCheckpointIO) -> None:
        """Every rank raises the same error: the lease's, else the failed save's."""
        lease = self._rt.lease if self._rt is not None else None
        agree.decide(lambda: lease.check() if lease is not None else None, self._group(), what="holding the lease")
        self._wait_agreed(trainer)

    def _wait_agreed(self, trainer: pl.Trainer) -> None:
        """Wait for pending saves; a failure on any rank raises on every rank."""
        agree.agree(self._plugin(trainer).wait, self._group(), what="saving the checkpoint")

    def _check_now(self, trainer: pl.Trainer) -> None:
        if not self.controller.schedule.bound:
            return
        decision = self.controller.now()
        if decision.preempt:
            self._emergency(trainer)

    def _save(self, trainer: pl.Trainer, kind: str = "periodic") -> None:
        step = trainer.global_step
        if step == self._last_saved_step:
            return
        path = self._fresh_path(trainer, step)
        self._save_kind = kind  # recorded by state_dict() inside this save
        trainer.save_checkpoint(path)
        self._last_saved_step = step
        self._last_saved_path = path
        self._last_save_time = time.monotonic()
        io = self._plugin(trainer)
        if trainer.is_global_zero and io.tiers is None:  # two tiers: each drain job applies retention per tier
            # Queued behind the save: runs after it committed (or failed; then the old
            # checkpoints are still the newest committed and are kept).
            io.submit(self._retention)
        self._grace.check_records(io.history[:-1])

    def _retention(self) -> None:
        try:
            apply_retention(self.dirpath, self.config.keep_last_n, self.storage_options, run_id=self.run_id)
        except Exception as err:  # the checkpoints stay; the next save's retention tries again
            log.warning(
                "lightning_preempt: retention in %s failed (%s: %s)\nHINT: older checkpoints were kept; check "
                "that the storage allows deletes. The next save retries.",
                self.dirpath, type(err).__name__, err,
            )  # fmt: skip

    def _fresh_path(self, trainer: pl.Trainer, step: int) -> str:
        """``dirpath/step-N``, or a suffixed sibling when a committed ``step-N`` exists (a run
        resumed from an older checkpoint re-reaches a step). Rank 0 decides for all ranks."""
        path = join_url(self.dirpath, checkpoint_name(step))
        tiers = self._plugin(trainer).tiers

        def pick() -> str:
            return f"{path}-{uuid.uuid4().hex[:8]}" if tier_policy.taken(tiers, path, self.storage_options) else path

        return agree.decide(pick, self._group(), what="choosing the checkpoint path")

    def _emergency(self, trainer: pl.Trainer) -> None:
        io = self._plugin(trainer)
        step = trainer.global_step

        def snapshot() -> None:
            try:
                self._wait_agreed(trainer)  # an in-flight periodic save is not lost: let it commit first
            except CheckpointError as err:
                log.error("lightning_preempt: the in-flight save failed (%s); snapshotting anyway", err)
                self._last_saved_step = None
            if step == self._last_saved_step or step == 0:
                self.controller.mark(f"step {step} is already committed; no snapshot needed")
                return
            self._save(trainer, kind="emergency")
            self.controller.mark(f"staged step {step}")
            self._wait_agreed(trainer)
            self.controller.mark(f"committed step {step}")
            for hook in list(self.snapshot_hooks):
                hook(trainer, step)

        def drain(budget: float) -> str:
            path = self._last_saved_path
            saved = (path, self._last_saved_step) if trainer.is_global_zero and path is not None else None
            return tier_policy.drain_within_grace(
                io, dirpath=self.dirpath, step=step, budget=budget, mark=self.controller.mark, saved=saved
            )

        self.controller.emergency(
            step, snapshot=snapshot, drain=drain, safe_step=lambda: self._safe_step(io), leader=trainer.is_global_zero
        )

    def _noticed(self, io: ShardedAsyncCheckpointIO, step: int) -> None:
        """on_notice="continue": log the snapshot a notice asked for and, from the writer
        thread behind the save, whether it committed (training does not wait)."""
        notice = self.controller.notice
        source = notice.source if notice is not None else "a"
        self.controller.mark(f"{source} notice: snapshot of step {step} staged; training goes on until the signal")

        def committed() -> None:
            rec = next((r for r in reversed(io.history) if r.step == step), None)
            ok = rec is not None and rec.committed_s is not None and rec.error is None
            self.controller.mark(f"committed step {step} (the {source} notice's snapshot)" if ok else
                                 f"the {source} notice's snapshot of step {step} did not commit")  # fmt: skip

        io.submit(committed)

    def _safe_step(self, io: ShardedAsyncCheckpointIO) -> str:
        done = [r for r in io.history if r.committed_s is not None and r.error is None]
        if done:
            return f"step {done[-1].step} ({done[-1].path})"
        if self.resumed_from is not None:
            return f"step {self._last_saved_step} ({self.resumed_from}, the checkpoint this run resumed from)"
        return "no checkpoint of this run committed (the newest in dirpath, if any)"

    def _warn_about_newer_checkpoints(self, trainer: pl.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        try:
            newer = [c.step for c in list_checkpoints(self.dirpath, self.storage_options) if c.committed]
        except Exception as err:  # a warning only: never let it stop training
            log.warning("lightning_preempt: cannot list %s to compare steps: %s", self.dirpath, err)
            return
        if newer and max(newer) > trainer.global_step:
            warnings.warn(
                f"lightning_preempt: resumed from step {trainer.global_step} but {self.dirpath} holds a newer "
                f"checkpoint (step {max(newer)}); after a preemption auto-resume takes the newest step.\n"
                "HINT: use a fresh dirpath for a run that branches off an older checkpoint.",
                stacklevel=2,
            )
