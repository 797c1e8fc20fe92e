"""Lightning's ``DeepSpeedStrategy`` (ZeRO 1-3) with committed checkpoints (docs/strategies.md).

DeepSpeed writes its own per-rank files (``zero_pp_rank_*`` / ``mp_rank_*``) with its own
checkpoint engine; this module makes each such save one of our checkpoints:

* ``save_checkpoint`` (every rank): rank 0 prepares the path as for any save of ours
  (write/commit.py ``prepare_path``: a fresh directory, leftovers cleared, a committed one
  replaced through a generation), DeepSpeed writes its files straight into it (its save
  blocks training, as without us), then a job on the plugin's writer thread reads back the
  files this rank wrote (CRC32C, fsync) and commits: the manifest, listing every rank's
  files with their sizes and CRC32C, is written by rank 0 once all ranks' files are written
  (write/commit.py ``commit_written``, the commit every save of ours goes through).
* ``load_checkpoint`` (every rank): the committed checkpoint the path means (the resume
  pointer, a checkpoint, a directory of them), its files verified against the manifest (each
  rank a share), a damaged one skipped for the next on every rank alike
  (read/load.py ``load_agreed``), then DeepSpeed's own load of exactly that directory.

DeepSpeed writes with ``torch.save`` to local paths: ``dirpath`` must be local. DeepSpeed is
imported lazily: the package imports without it.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any

from lightning_preempt.catalog.verified import mark_verified
from lightning_preempt.collective import agree
from lightning_preempt.collective import groups as pdist
from lightning_preempt.errors import CheckpointError, CheckpointWriteError, earlier_save_failed
from lightning_preempt.format.manifest import FileEntry, Manifest, data_store
from lightning_preempt.format.names import DEEPSPEED_FILE_RE
from lightning_preempt.lightning import _compat
from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO
from lightning_preempt.read.load import load_agreed
from lightning_preempt.read.verify import read_manifest, verify_checkpoint
from lightning_preempt.save.history import HISTORY_KEPT, SaveRecord, checkpoint_step
from lightning_preempt.storage.checksum import Crc32c
from lightning_preempt.storage.store import CHUNK_BYTES, Store
from lightning_preempt.write.commit import commit_written, prepare_path

log = logging.getLogger(__name__)

#: Keys of Lightning's checkpoint dict DeepSpeed saves itself (Lightning drops them too).
_DEEPSPEED_KEYS = ("state_dict", "optimizer_states")
_LOCAL_HINT = (
    "DeepSpeed writes its files with torch.save to local paths: give PreemptionCallback a local dirpath "
    "(a shared filesystem every rank sees), without local_dirpath."
)


def install(strategy: Any, io: ShardedAsyncCheckpointIO) -> None:
    """Route ``strategy``'s (a ``DeepSpeedStrategy``) saves and loads through committed
    checkpoints (module docstring). Every rank calls it at set-up."""
    if io.saver.tiers is not None:
        raise CheckpointError(
            "DeepSpeedStrategy cannot use two tiers (local_dirpath): DeepSpeed writes its own files",
            hint=_LOCAL_HINT,
        )
    saves = _Saves(io)

    def save(self: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        saves.save(self, checkpoint, str(self.broadcast(str(filepath))), storage_options)

    def load(self: Any, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Each rank's own path: the resume pointer is a file of its own, aliased on every rank.
        path = str(checkpoint_path)
        resolved = agree.decide(lambda: io.resolve(path), pdist.world_group(), what="resolving the checkpoint")
        if resolved is None:  # not one of ours (a DeepSpeed directory of its own): Lightning's load
            # the class's own (a second fit installs again: never our own wrapper)
            return type(self).load_checkpoint(self, checkpoint_path, weights_only)  # type: ignore[no-any-return]
        return saves.load(self, path, resolved)

    _compat.rebind(strategy, "deepspeed", save_checkpoint=save, load_checkpoint=load)


class _Saves:
    """One strategy's DeepSpeed saves: the commit in flight and its outcome."""

    def __init__(self, io: ShardedAsyncCheckpointIO) -> None:
        self.io = io
        self._committing: Future[Manifest] | None = None

    # ---- saving ------------------------------------------------------------------------
    def save(self, strategy: Any, checkpoint: dict[str, Any], url: str, storage_options: Any) -> None:
        self._settle()  # the writer's group is free; an earlier failure is raised here
        options = dict(self.io.order(url, storage_options).options)
        root = Store(url, options)
        if not root.is_local:
            raise CheckpointError(f"DeepSpeedStrategy cannot save to {url}", path=url, hint=_LOCAL_HINT)
        started = time.perf_counter()
        record = SaveRecord(url, checkpoint_step(checkpoint), started)
        group = self.io.saver.group
        plan = prepare_path(root, group)
        data = plan.data(root).path()
        engine = strategy.deepspeed_engine
        recorder = _Recorder(engine, data)
        client_state = {k: v for k, v in checkpoint.items() if k not in _DEEPSPEED_KEYS}
        with recorder:
            # The directory is the tag under its parent: DeepSpeed's files land in it, nothing
            # beside it (no ``latest``: our manifest says what is committed).
            engine.save_checkpoint(
                os.path.dirname(data), tag=os.path.basename(data), client_state=client_state, save_latest=False,
                exclude_frozen_parameters=getattr(strategy, "exclude_frozen_parameters", False),
            )  # fmt: skip
        record.blocking_s = blocking_s = time.perf_counter() - started
        step, epoch = record.step, int(checkpoint.get("epoch", -1))
        saver = self.io.saver
        # In the saver's history like its own saves: the ledger, the exit log, the metrics see it.
        saver.history.append(record)
        del saver.history[:-HISTORY_KEPT]

        def commit() -> Manifest:
            try:
                manifest = commit_written(
                    root, plan, lambda: _checksum(recorder.written), group=group, step=step, epoch=epoch,
                    run_id=saver.run_id, stats={"blocking_s": blocking_s}, started=started,
                )  # fmt: skip
            except BaseException as err:
                record.error = err
                raise
            record.bytes = manifest.total_bytes
            record.committed_s = time.perf_counter() - started
            if pdist.rank(group) == 0:
                mark_verified(url, manifest)
                log.info("lightning_preempt: committed %s (step %d, DeepSpeed): blocked %.3fs, committed after %.3fs",
                         url, step, blocking_s, record.committed_s)  # fmt: skip
            return manifest

        # Queued behind earlier jobs, before the retention the engine queues after this save:
        # retention sees it committed. Waited for by the engine (``saver.wait``) and here.
        self._committing = saver.submit(commit)

    def _settle(self) -> None:
        """Wait for the commit in flight; raise its failure (every rank knows it: agreed)."""
        pending, self._committing = self._committing, None
        if pending is None:
            return
        err = pending.exception()
        if err is not None:
            raise earlier_save_failed(err, "the previous DeepSpeed checkpoint was not committed") from err

    # ---- loading -----------------------------------------------------------------------
    def load(self, strategy: Any, path: str, target: str) -> dict[str, Any]:
        """Verify ``target`` (each rank a share of its files; on damage every rank moves on to
        the same older one), then DeepSpeed's own load of it; Lightning's ``client_state``."""
        self._settle()
        self.io.saver.wait()
        group = self.io.saver.group
        verify = self.io.config.verify_on_load

        def check(at: str, verified: bool) -> dict[str, Any]:
            store = Store(at, self.io.storage_options)
            manifest = read_manifest(store)
            if verify and not verified:
                verify_checkpoint(store, manifest, share=(pdist.rank(group), pdist.world_size(group)))
            return {"data": data_store(store, manifest).path()}

        fallback = self.io.loader.fallback_for(path) if verify else None
        found, loaded_from = load_agreed(check, target, False, fallback, group)
        data = found["data"]
        module = strategy.lightning_module
        from lightning.pytorch.trainer.states import TrainerFn

        fitting = module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = strategy.deepspeed_engine.load_checkpoint(
            os.path.dirname(data), tag=os.path.basename(data), load_optimizer_states=fitting,
            load_lr_scheduler_states=False, load_module_strict=module.strict_loading,
        )  # fmt: skip
        if client_state is None:
            raise CheckpointError(
                "DeepSpeed loaded no state from a committed checkpoint",
                path=loaded_from,
                hint="The checkpoint was written under another DeepSpeed configuration (ZeRO stage or world "
                "size); resume it with the configuration that wrote it.",
            )
        self.io.loader.loaded_from = loaded_from
        how = "its files verified against its manifest" if verify else "verify_on_load=False: not verified"
        log.info("lightning_preempt: DeepSpeed loaded %s (%s)", loaded_from, how)
        return client_state  # type: ignore[no-any-return]


class _Recorder:
    """Within it, the paths ``engine``'s checkpoint engine writes into ``data`` (this rank's files)."""

    def __init__(self, engine: Any, data: str) -> None:
        self.engine, self.data = engine, os.path.realpath(data)
        self.written: list[str] = []

    def __enter__(self) -> _Recorder:
        ckpt = self.engine.checkpoint_engine
        if ckpt.is_decoupled():
            raise CheckpointError(
                f"DeepSpeed's {type(ckpt).__name__} commits in the background: its files cannot be listed when "
                "its save returns",
                hint="Use DeepSpeed's default checkpoint engine with PreemptionCallback (no "
                "checkpoint.writer/decoupled settings in the DeepSpeed config).",
            )
        original = ckpt.save

        def save(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            if os.path.dirname(os.path.realpath(path)) != self.data:
                raise CheckpointError(
                    f"DeepSpeed wrote {path} outside the checkpoint directory {self.data}",
                    path=self.data,
                    hint="Disable DeepSpeed features that write elsewhere (NVMe offload, pipeline layers) "
                    "or save without PreemptionCallback.",
                )
            result = original(state_dict, path, *args, **kwargs)
            self.written.append(path)
            return result

        ckpt.save = save
        # Its recovery scripts go to the parent (dirpath): `python -m deepspeed.utils.zero_to_fp32`.
        self.engine._copy_recovery_script = lambda save_path: None
        return self

    def __exit__(self, *exc: object) -> None:
        vars(self.engine.checkpoint_engine).pop("save", None)
        vars(self.engine).pop("_copy_recovery_script", None)


def _checksum(paths: list[str]) -> dict[str, FileEntry]:
    """This rank's files, read back once: size and CRC32C each, made durable (fsync) before
    the manifest that lists them is written."""
    entries = {}
    for path in paths:
        name = os.path.basename(path)
        if not DEEPSPEED_FILE_RE.fullmatch(name):
            raise CheckpointWriteError(
                f"DeepSpeed wrote {name!r}, a file this package does not know",
                path=os.path.dirname(path),
                hint="Save this model without PreemptionCallback, or report the DeepSpeed version and setup.",
            )
        crc = Crc32c()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                crc.update(chunk)
            os.fsync(f.fileno())
        entries[name] = FileEntry(crc.nbytes, crc.hexdigest())
    return entries

