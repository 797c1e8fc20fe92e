"""Every patch this package makes to Lightning, torch or DeepSpeed, in one list (:data:`PATCHES`),
and the shims for their private names (``trainer.py``: the Trainer's; ``fabric.py``: Fabric's;
torch's DCP names: format/dcp_compat.py; every private use: docs/compat.md).

A patch is a change to an object we do not own: a method wrapped on a class, a method bound
on one instance, a function replaced, an attribute set that changes what the object does.
Each is made by the code named in ``where`` (Lightning's through this package; layers below
the front-ends, which cannot import it, by their own modules), and
tests/unit/test_patches.py fails when a module makes one that this list does not name.
Instance methods are bound through :func:`rebind`, which takes the entry's key.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

from lightning_preempt.lightning._compat.fabric import (
    convert_fabric_state,
    fabric_loader_parts,
    fabric_save,
    route_fabric_saves,
)
from lightning_preempt.lightning._compat.trainer import (
    allow_with_disabled_checkpointing,
    at_fit_setup,
    build_ddp_through,
    quiet_ckpt_path_choice,
    refresh_train_batches,
    reload_train_data,
    restore_late,
    set_sampler_epoch,
    tolerate_preempted_children,
    train_fetcher,
    train_loader_iterators,
    train_loaders,
    train_reload_due,
    training_results,
    unwrap_optimizer,
    wrap_once,
)

__all__ = [
    "PATCHES", "Patch", "allow_with_disabled_checkpointing", "at_fit_setup", "build_ddp_through",
    "convert_fabric_state", "fabric_loader_parts", "fabric_save", "quiet_ckpt_path_choice", "rebind",
    "refresh_train_batches", "reload_train_data", "restore_late", "route_fabric_saves", "set_sampler_epoch",
    "tolerate_preempted_children", "train_fetcher", "train_loader_iterators", "train_loaders",
    "train_reload_due", "training_results", "unwrap_optimizer", "wrap_once",
]  # fmt: skip


class Patch(NamedTuple):
    """One patch: what it changes, the code that makes it, why, and the versions it was checked on."""

    what: str
    where: str
    why: str
    checked: str


#: Run by the suite on every commit (the dev pins), and on the floors by scripts/test_min_versions.sh.
CHECKED = "Lightning 2.6.6, torch 2.13.0; floors Lightning 2.5.0, torch 2.7 (docs/compat.md)"
_DEEPSPEED = "DeepSpeed 0.19.8 with Lightning 2.6.6, torch 2.13.0 (tests/multiproc/test_deepspeed.py; not installed by default)"

PATCHES: dict[str, Patch] = {
    # ---- Lightning, on the class (once per process, marked; other Trainers unchanged) ------------
    "disabled_checkpointing": Patch(
        "_CallbackConnector._configure_checkpoint_callbacks (wrapped)", "lightning/_compat/trainer.py",
        "Trainer(enable_checkpointing=False) accepts PreemptionCallback, which must stay a Checkpoint", CHECKED),
    "quiet_ckpt_path": Patch(
        "_CheckpointConnector._parse_ckpt_path (wrapped)", "lightning/_compat/trainer.py",
        "Lightning's 'last checkpoint' warnings, untrue on the auto-resume route, quiet for our Trainers", CHECKED),
    "fit_setup_check": Patch(
        "_CallbackConnector._attach_model_callbacks (wrapped)", "lightning/_compat/trainer.py",
        "the plugin without PreemptionCallback warns at fit's set-up (it sees no Trainer otherwise)", CHECKED),
    "fabric_saves": Patch(
        "lightning.fabric Strategy.save_checkpoint (wrapped; lightning/checkpoint_io.py wrap_save)",
        "lightning/_compat/fabric.py",
        "fabric.save with our plugin saves on every rank (the base class calls CheckpointIO on rank 0)", CHECKED),
    # ---- Lightning, on one instance (that Trainer's or Fabric's objects only) --------------------
    "restore_late": Patch(
        "trainer._checkpoint_connector.resume_start (replaced once)", "lightning/_compat/trainer.py",
        "a job that waited for the lease loads what the previous holder committed meanwhile", CHECKED),
    "ddp_buckets": Patch(
        "DDPStrategy._setup_model (instance)", "lightning/_compat/trainer.py",
        "DDP is built in the resumed checkpoint's gradient-bucket layout (bit-exact at 3+ ranks)", CHECKED),
    "child_observer": Patch(
        "_ChildProcessObserver._run (the launcher's thread)", "lightning/_compat/trainer.py",
        "a child's preemption exit gives the others grace_period_s instead of Lightning's SIGKILL", CHECKED),
    "every_rank_saves": Patch(
        "Strategy.save_checkpoint (instance: DDP and any strategy with the base method)",
        "lightning/strategies.py", "every rank writes ~1/N (Lightning calls CheckpointIO on rank 0 only)", CHECKED),
    "sharded_saves": Patch(
        "FSDPStrategy/ModelParallelStrategy .save_checkpoint, .load_checkpoint (instance)",
        "lightning/sharded_saves.py", "their DCP saves bypass CheckpointIO: ours commit with a manifest, "
        "load ours resharded", CHECKED),
    "fsdp1_state": Patch(
        "FSDPStrategy .lightning_module_state_dict, .optimizer_state, .teardown (instance); "
        "kwargs['device_mesh'] when none given", "lightning/sharded_saves.py",
        "sharded DTensor state whatever state_dict_type (never gathered on rank 0); its teardown skips the "
        "plugin's", CHECKED),
    "deepspeed": Patch(
        "DeepSpeedStrategy .save_checkpoint, .load_checkpoint (instance); during a save its checkpoint "
        "engine's .save and engine._copy_recovery_script", "lightning/deepspeed.py",
        "DeepSpeed's own files committed by our manifest; the files it writes recorded", _DEEPSPEED),
    "fabric_sharded": Patch(
        "lightning.fabric FSDPStrategy/ModelParallelStrategy .save_checkpoint, .load_checkpoint (instance), "
        "._lightning_preempt_io", "fabric/sharded.py", "as sharded_saves, for fabric.save/fabric.load", CHECKED),
    "plugin": Patch(
        "Strategy.checkpoint_io (its public setter) where it holds Lightning's default TorchCheckpointIO",
        "lightning/strategies.py", "PreemptionCallback/Preemption without a plugin configured install ours", CHECKED),
    "loop_counts": Patch(
        "CombinedLoader.limits, fit_loop.max_batches, trainer.val_check_batch, trainer.accumulate_grad_batches",
        "lightning/_compat/trainer.py, lightning/exact.py", "a resharded epoch's loaders change length; "
        "global_batch='keep' changes the accumulation", CHECKED),
    "overlap_gate": Patch(
        "trainer.callbacks (OverlapGate inserted first)", "lightning/staging_hooks.py",
        "an overlapped copy settles before any other callback's hook of the same name", CHECKED),
    "log_names": Patch(
        "Lightning's logger (a filter renaming the resume pointer) and warnings.filters (scoped entries)",
        "lightning/logs.py", "Lightning's log names the checkpoint, not our pointer; warnings untrue on our "
        "route are quiet", CHECKED),
    # ---- torch (below the front-ends) ---------------------------------------------------------
    "bucket_assignment": Patch(
        "torch.distributed._compute_bucket_assignment_by_size (during one DDP constructor)",
        "resume/ddp_buckets.py", "DDP's first buckets are the saved run's", CHECKED),
    "zip_crc32": Patch(
        "torch.serialization.get_crc32_options (wrapped; False only on our writer's thread)",
        "write/dcp_writer.py", "torch.save inside our writer skips the zip CRC-32: our CRC32C covers its records",
        CHECKED),
    "optimizer_gate": Patch(
        "a global optimizer step pre-hook (torch.optim.optimizer.register_optimizer_step_pre_hook)",
        "staging/overlap.py", "an optimizer step waits for the overlapped copy of what it changes", CHECKED),
    "loader_samplers": Patch(
        "a DataLoader's batch_sampler.sampler, a sampler's generator (replaced while resuming)",
        "resume/samplers.py, resume/loaders.py", "exact resume: the data order continues mid-epoch", CHECKED),
    "loader_workers": Patch(
        "DataLoader.worker_init_fn (chained)", "preemption/signals.py",
        "loader workers ignore the preemption signals (the trainer takes its snapshot first)", CHECKED),
    "metric_states": Patch(
        "torchmetrics Metric._update_count, ._computed and its states' devices", "resume/exact_state.py",
        "exact resume: metric states, which are not in state_dict", "torchmetrics 1.9.0; " + CHECKED),
    "dcp_warning": Patch(
        "warnings.filters (DCP's 'torch.distributed is disabled' message, from the first no_dist call)",
        "format/dcp_compat.py", "a single-process DCP call is what we mean, not a mistake", CHECKED),
}


def rebind(obj: Any, patch: str, **methods: Callable[..., Any]) -> None:
    """Bind each of ``methods`` on the instance ``obj`` by its name (its class and other
    instances keep theirs), as :data:`PATCHES` ``[patch]`` says."""
    if patch not in PATCHES:
        raise KeyError(f"lightning_preempt: no patch {patch!r} in lightning/_compat/__init__.py PATCHES")
    for name, method in methods.items():
        setattr(obj, name, types.MethodType(method, obj))
