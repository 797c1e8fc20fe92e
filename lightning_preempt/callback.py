"""The Lightning callback: when to save, preemption handling, exit, and auto-resume.

Policy lives here; the mechanism (staging, writing, committing, verifying) lives in
:class:`ShardedAsyncCheckpointIO` and below. See ``docs/design.md`` for the resume hook.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
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

from lightning_preempt import dist as pdist
from lightning_preempt.agreement import AgreementSchedule
from lightning_preempt.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.discovery import apply_retention, checkpoint_name, list_checkpoints, newest_valid
from lightning_preempt.errors import CheckpointError, NotACheckpointError
from lightning_preempt.exact import STATE_KEY, ExactResume
from lightning_preempt.grace import GraceCheck, grace_margin
from lightning_preempt.manifest import MANIFEST_NAME
from lightning_preempt.reporting import SaveReporter, report_resume
from lightning_preempt.signals import SignalFlag
from lightning_preempt.storage import Store, join_url
from lightning_preempt.strategy_hooks import install_collective_saves
from lightning_preempt.tiers import TwoTier, complete_local_checkpoints, local_dirpath_from_env

log = logging.getLogger(__name__)

# Lightning warns about "last" checkpoints when an OnExceptionCheckpoint is present and
# fit() gets no ckpt_path: that is exactly our auto-resume path, so the text misleads.
warnings.filterwarnings("ignore", message=r".*ckpt_path=None\)` was called without a model.*")
warnings.filterwarnings("ignore", message=r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint.*")


class Preempted(SystemExit):
    """Raised on every rank after the emergency snapshot; exits with the configured code."""


class PreemptionCallback(OnExceptionCheckpoint):
    """Periodic async checkpoints, a snapshot on preemption, and resume on restart.

    Add it with :class:`ShardedAsyncCheckpointIO` to the ``Trainer``; ``trainer.fit(model)``
    then resumes from the newest valid checkpoint in ``dirpath`` on every (re)start.

    Args:
        dirpath: where checkpoints go (any fsspec URL: local path, ``gs://``, ``s3://``…).
        every_n_train_steps: save every N optimizer steps.
        every_n_seconds: save when this much wall time passed since the last save.
        keep_last_n: committed checkpoints to keep (older ones are deleted after a newer commit).
        signals: signals that mean "preempted" (SLURM can send ``SIGUSR1`` earlier).
        grace_period_s: time between the signal and SIGKILL; used to warn when a snapshot
            is projected not to fit.
        exit_code: process exit code after the snapshot (143 = 128 + SIGTERM).
        requeue: run ``scontrol requeue`` on rank 0 before exiting; ``None``: when under SLURM.
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
            node-local directory first and drain it to ``dirpath`` in the background; resume
            takes the newest across both. Also settable on the plugin; pass it here too so a
            checkpoint that only this node's disk holds is found on restart.
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
        agree_every_n_steps: int | Literal["auto"] = "auto",
        agree_interval_s: float = 0.25,
        overlap_agreement: bool = True,
        resume: bool = True,
        save_on_train_end: bool = True,
        storage_options: dict[str, Any] | None = None,
        local_dirpath: str | None = None,
    ) -> None:
        if not dirpath:
            raise ValueError(
                "dirpath must name a directory or URL\nHINT: e.g. dirpath='checkpoints/' or 'gs://bucket/run'."
            )
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_seconds", every_n_seconds)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value!r}\nHINT: pass None to disable it.")
        if keep_last_n < 1:
            raise ValueError(f"keep_last_n must be >= 1, got {keep_last_n}\nHINT: keep at least the newest checkpoint.")
        super().__init__(dirpath=str(dirpath).rstrip("/") or str(dirpath))
        self.dirpath: str = str(dirpath).rstrip("/") or str(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.every_n_seconds = every_n_seconds
        self.keep_last_n = keep_last_n
        self.grace_period_s = grace_period_s
        self.exit_code = exit_code
        self.requeue = requeue
        self.agree_every_n_steps = agree_every_n_steps
        self.agree_interval_s = agree_interval_s
        self.overlap_agreement = overlap_agreement
        self.resume = resume
        self.save_on_train_end = save_on_train_end
        self.storage_options = dict(storage_options or {})
        self.local_dirpath = local_dirpath_from_env(local_dirpath)
        self._last_saved_path: str | None = None
        self.signal_flag = SignalFlag(signals)
        self.timeline: list[tuple[str, float]] = []
        self.resumed_from: str | None = None
        self._pointer: str | None = None
        self._agreement = AgreementSchedule(agree_every_n_steps, agree_interval_s, overlap_agreement)
        self._grace = GraceCheck(grace_period_s)
        self._reporter = SaveReporter()
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        self._last_seen_step: int | None = None
        self._save_kind = "periodic"
        self._restored_state: dict[str, Any] | None = None
        self.exact = ExactResume()  # RNG, data position, metric states; `.enabled = False` turns it off

    # ---- auto-resume -------------------------------------------------------------------
    @property
    @override
    def ckpt_path(self) -> str | None:  # type: ignore[override]
        """Read by Lightning when ``fit()`` gets no ``ckpt_path`` (see docs/design.md).

        Returns a local pointer file when ``dirpath`` holds a committed checkpoint; the
        plugin maps the pointer to the checkpoint all ranks agreed on in :meth:`setup`.
        """
        if not self.resume:
            return None
        # Two tiers: a complete local checkpoint counts (every rank of a one-host job sees it).
        has_checkpoint = self.local_dirpath is not None and bool(complete_local_checkpoints(self.local_dirpath))
        try:
            has_checkpoint = has_checkpoint or any(
                c.committed for c in list_checkpoints(self.dirpath, self.storage_options)
            )
        except (OSError, CheckpointError) as err:
            log.warning("lightning_preempt: cannot list %s (%s); starting without resume", self.dirpath, err)
            if not has_checkpoint:
                return None
        if not has_checkpoint:
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

    # ---- set-up ------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        io = self._ensure_plugin(trainer)
        writer_group = pdist.new_gloo_group()
        agree_group = pdist.new_gloo_group()
        self._agreement.bind(agree_group)
        install_collective_saves(trainer.strategy, io, writer_group)
        self._configure_tiers(trainer, io)
        # Collective on every rank: ranks that disagree on whether to resume would diverge.
        wants = pdist.all_gather_objects(self._pointer is not None, agree_group)
        if any(wants) and not all(wants):
            raise NotACheckpointError(
                f"ranks disagree on whether {self.dirpath} holds a checkpoint (per rank: {wants})",
                path=self.dirpath,
                hint="dirpath must be storage that every rank sees (a shared filesystem or an object store).",
            )
        if self._pointer is not None:
            self._agree_resume_target(trainer, io)
        self._upload_local_only(trainer, io)
        newest = next((c for c in list_checkpoints(self.dirpath, self.storage_options) if c.committed), None)
        self._grace.check_manifest(newest.manifest if newest else None)
        self.signal_flag.clear()
        self.signal_flag.install()

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

    def _agree_resume_target(self, trainer: pl.Trainer, io: ShardedAsyncCheckpointIO) -> None:
        skipped: list[str] = []

        def note(info: Any, reason: str) -> None:
            skipped.append(f"{info.name}: {reason}")
            log.warning("lightning_preempt: skipping checkpoint %s (step %d): %s", info.path, info.step, reason)

        chosen = None
        if trainer.is_global_zero:
            if io.tiers is not None:  # newest across both tiers; local wins a tie
                info = io.tiers.newest(verify=io.verify_on_load, on_skip=note)
            else:
                info = newest_valid(self.dirpath, self.storage_options, verify=io.verify_on_load, on_skip=note)
            chosen = (info.path, info.step) if info is not None else None
        chosen = trainer.strategy.broadcast(chosen, src=0)  # one rank decides, the rest follow
        assert self._pointer is not None
        if chosen is None:
            raise NotACheckpointError(
                "every checkpoint found is uncommitted or corrupt",
                path=self.dirpath,
                hint="Inspect them with `lightning-preempt ls --verify DIR`; delete the damaged ones "
                "(or pass ckpt_path explicitly) and restart.",
            )
        path, step = chosen
        # Rank 0 read every file for its CRC32C while choosing: loading need not again.
        io.alias(self._pointer, path, verified=trainer.is_global_zero and io.verify_on_load)
        self.resumed_from = path
        self._last_saved_step = step
        log.info(
            "lightning_preempt: resuming from %s (step %d)%s", path, step, f"; skipped {skipped}" if skipped else ""
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint: why it was taken (read back to report steps lost)."""
        return {
            "kind": self._save_kind,
            "signal": self.signal_flag.received.name if self.signal_flag.received else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_state = dict(state_dict)

    # ---- training-time hooks -----------------------------------------------------------
    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.signal_flag.install()  # Lightning installed its own handler just before the run stage

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.signal_flag.install()
        self._last_save_time = time.monotonic()
        self._last_seen_step = trainer.global_step
        if self._last_saved_step is None and trainer.global_step > 0:
            self._last_saved_step = trainer.global_step  # resumed from an explicit ckpt_path
            self._warn_about_newer_checkpoints(trainer)
        # A signal that arrived during start-up or restore: nothing new to save.
        report_resume(trainer, self._restored_state)
        self._check_signal(trainer)
        self.exact.on_train_start(trainer, pl_module)  # last: restores RNG just before the first fetch

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.exact.on_train_batch_end(trainer)
        self._reporter.report(trainer, self._plugin(trainer).history)
        step = trainer.global_step
        if step == self._last_seen_step:
            return  # mid gradient-accumulation: no optimizer step happened, nothing to snapshot
        self._last_seen_step = step
        now = time.monotonic()
        local_due = self.every_n_seconds is not None and now - self._last_save_time >= self.every_n_seconds
        signalled, time_due = self._agreement.at_boundary(now, self.signal_flag.is_set, local_due)
        if signalled:
            self._emergency(trainer)
        step_due = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        if step_due or time_due:
            self._save(trainer)

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
        self._check_signal(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._agreement.flush()  # every rank completes its overlapped exchange
        if self.save_on_train_end and trainer.global_step != self._last_saved_step and trainer.global_step > 0:
            self._save(trainer, kind="final")
        self._plugin(trainer).wait()
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
        self.signal_flag.restore()
        if isinstance(exception, Preempted):
            return
        with contextlib.suppress(Exception):
            self._plugin(trainer).wait()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.signal_flag.restore()
        if self._pointer is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._pointer)
            self._pointer = None

    # ---- mechanics ---------------------------------------------------------------------
    def _plugin(self, trainer: pl.Trainer) -> ShardedAsyncCheckpointIO:
        io = trainer.strategy.checkpoint_io
        assert isinstance(io, ShardedAsyncCheckpointIO)
        return io

    def _check_signal(self, trainer: pl.Trainer) -> None:
        if self._agreement.bound and self._agreement.now(self.signal_flag.is_set):
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
            io.submit(lambda: apply_retention(self.dirpath, self.keep_last_n, self.storage_options))
        self._grace.check_records(io.history[:-1])

    def _fresh_path(self, trainer: pl.Trainer, step: int) -> str:
        """``dirpath/step-N``, or a suffixed sibling when a committed ``step-N`` exists (a run
        resumed from an older checkpoint re-reaches a step). Rank 0 decides for all ranks."""
        path = join_url(self.dirpath, checkpoint_name(step))
        if trainer.is_global_zero and self._taken(trainer, path):
            path = f"{path}-{uuid.uuid4().hex[:8]}"
        return str(trainer.strategy.broadcast(path, src=0))

    def _mark(self, event: str) -> None:
        origin = self.signal_flag.received_at
        now = time.monotonic()
        self.timeline.append((event, now))
        since = f"{now - origin:.3f}s after the signal" if origin is not None else "no local signal"
        log.warning("lightning_preempt: [preemption] %s (%s)", event, since)

    def _emergency(self, trainer: pl.Trainer) -> None:
        self._mark(f"ranks agreed to preempt at step {trainer.global_step}")
        self._agreement.flush()
        io = self._plugin(trainer)
        try:
            io.wait()  # an in-flight periodic save is not lost: let it commit first
        except CheckpointError as err:
            log.error("lightning_preempt: the in-flight save failed (%s); snapshotting anyway", err)
            self._last_saved_step = None
        step = trainer.global_step
        if step == self._last_saved_step or step == 0:
            self._mark(f"step {step} is already committed; no snapshot needed")
        else:
            self._save(trainer, kind="emergency")
            self._mark(f"staged step {step}")
            io.wait()
            self._mark(f"committed step {step}")
        held = self._drain_within_grace(trainer, io, step)
        self._maybe_requeue(trainer)
        self._mark(f"exiting with code {self.exit_code}{held}")
        raise Preempted(self.exit_code)

    def _maybe_requeue(self, trainer: pl.Trainer) -> None:
        job = os.environ.get("SLURM_JOB_ID")
        wanted = self.requeue if self.requeue is not None else job is not None
        if not wanted or not trainer.is_global_zero or job is None:
            return
        if shutil.which("scontrol") is None:
            log.warning("lightning_preempt: requeue requested but `scontrol` is not on PATH")
            return
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=20, check=False)
        level = logging.INFO if result.returncode == 0 else logging.ERROR
        log.log(level, "lightning_preempt: scontrol requeue %s -> %d %s", job, result.returncode, result.stderr.strip())

    def _warn_about_newer_checkpoints(self, trainer: pl.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        newer = [c.step for c in list_checkpoints(self.dirpath, self.storage_options) if c.committed]
        if newer and max(newer) > trainer.global_step:
            warnings.warn(
                f"lightning_preempt: resumed from step {trainer.global_step} but {self.dirpath} holds a newer "
                f"checkpoint (step {max(newer)}); after a preemption auto-resume takes the newest step.\n"
                "HINT: use a fresh dirpath for a run that branches off an older checkpoint.",
                stacklevel=2,
            )

    # ---- two tiers ---------------------------------------------------------------------
    def _configure_tiers(self, trainer: pl.Trainer, io: ShardedAsyncCheckpointIO) -> None:
        """Tell the plugin the remote root and retention; give its drain thread a gloo group."""
        if self.local_dirpath is not None and io.tiers is None:
            io.tiers = TwoTier(self.local_dirpath, io.storage_options)
        elif io.tiers is not None and self.local_dirpath is None:
            self.local_dirpath = io.tiers.local_root
        elif io.tiers is not None and io.tiers.local_root != str(self.local_dirpath).rstrip("/"):
            raise ValueError(
                f"local_dirpath differs: {self.local_dirpath!r} (callback) vs {io.tiers.local_root!r} (plugin)\n"
                "HINT: pass the same local_dirpath to both, or to one of them."
            )
        if io.tiers is None:
            return
        drain_group = pdist.new_gloo_group()  # collective: every rank configures tiers alike
        collective = pdist.is_distributed() and io._group is not None
        io.set_tiers(self.dirpath, keep_last_n=self.keep_last_n, group=drain_group if collective else None)

    def _upload_local_only(self, trainer: pl.Trainer, io: ShardedAsyncCheckpointIO) -> None:
        """Queue the upload of the newest checkpoint that only this node's disk holds (before
        any retention of the remote tier runs: drains run in order)."""
        if io.tiers is None or not trainer.is_global_zero:
            return
        try:
            pending = io.tiers.local_only()
        except Exception as err:
            log.warning("lightning_preempt: cannot compare the tiers (%s); no upload on start", err)
            return
        if not pending:
            return
        newest = pending[-1]
        remote_url = io.tiers.remote_twin(newest.path)
        if remote_url is None:
            return
        log.info(
            "lightning_preempt: %s (step %d) is committed locally but not in %s: uploading it",
            newest.path, newest.step, self.dirpath,
        )  # fmt: skip
        io.tiers.queue_drain(newest.path, remote_url, newest.step, solo=True)

    def _taken(self, trainer: pl.Trainer, path: str) -> bool:
        tiers = self._plugin(trainer).tiers
        if tiers is None:
            return Store(path, self.storage_options).exists(MANIFEST_NAME)
        local = tiers.local_twin(path)  # the training thread touches only the local disk
        return local is not None and tiers.committed(local)

    def _drain_within_grace(self, trainer: pl.Trainer, io: ShardedAsyncCheckpointIO, step: int) -> str:
        """Two tiers: drain for what the grace period leaves; returns "; step N held by …"."""
        if io.tiers is None:
            return ""
        origin = self.signal_flag.received_at or time.monotonic()
        # Keep the same margin as the grace warning: the process must still tear down and
        # exit with exit_code before SIGKILL (a drain cut short leaves no remote manifest).
        budget = self.grace_period_s - grace_margin(self.grace_period_s) - (time.monotonic() - origin)
        self._mark(f"draining step {step} to {self.dirpath} for at most {max(budget, 0.0):.1f}s")
        finished = io.wait_drained(max(budget, 0.0))
        self._mark("drained" if finished else "drain did not finish within the grace period")
        if not trainer.is_global_zero or self._last_saved_path is None:
            return ""
        held = io.tiers.holders(self._last_saved_path)
        return f"; step {self._last_saved_step} held by: {', '.join(held) or 'no tier (see the errors above)'}"
