"""The Trainer's private names and patches (the list of every patch: ``_compat/__init__.py``);
each shim says what happens when the name is missing (all private uses: docs/compat.md).
Checked with Lightning 2.5.0 (the floor) and 2.6.6 by tests/unit/test_exact_compat.py.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

log = logging.getLogger(__name__)

# ---- Trainer(enable_checkpointing=False) --------------------------------------------------
_ALLOWED: list[type] = []


def allow_with_disabled_checkpointing(callback_type: type) -> None:
    """Let ``Trainer(enable_checkpointing=False, callbacks=[callback_type(...)])`` work.

    Lightning refuses every ``Checkpoint`` callback then, and ours must stay one (it is how
    ``fit()`` finds the checkpoint to resume). When every checkpoint callback is a
    ``callback_type``, configure as with checkpointing on: nothing is added. With a
    ``ModelCheckpoint`` too, Lightning's error stays: it is then accurate.

    Private: ``_CallbackConnector._configure_checkpoint_callbacks`` (Lightning 2.5-2.6).
    Without it Lightning's refusal stays.
    """
    if callback_type not in _ALLOWED:
        _ALLOWED.append(callback_type)

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def configure(self: Any, enable_checkpointing: bool, *args: Any, **kwargs: Any) -> None:
            checkpoints = self.trainer.checkpoint_callbacks
            if not enable_checkpointing and checkpoints and all(isinstance(cb, tuple(_ALLOWED)) for cb in checkpoints):
                enable_checkpointing = True  # with checkpoint callbacks given, Lightning adds none
            original(self, enable_checkpointing, *args, **kwargs)

        return configure

    wrap_once("lightning.pytorch.trainer.connectors.callback_connector", "_CallbackConnector",
               "_configure_checkpoint_callbacks", wrap)  # fmt: skip


def wrap_once(module: str, cls_name: str, method: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``module.cls_name.method`` by ``wrap(original)``, once per process (a second call
    finds the mark); nothing when Lightning moved or renamed it (the caller's docstring says
    what is lost then)."""
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):  # pragma: no cover - moved in a newer Lightning
        return
    original = getattr(cls, method, None)
    if original is None or getattr(original, "_lightning_preempt", False):
        return
    wrapped = functools.wraps(original)(wrap(original))
    wrapped._lightning_preempt = True  # type: ignore[attr-defined]
    setattr(cls, method, wrapped)


# ---- fit()'s checkpoint path (the auto-resume route, docs/design.md) ---------------------
_QUIET_CHOICE: dict[type, Callable[[], AbstractContextManager[object]]] = {}


def quiet_ckpt_path_choice(callback_type: type, quiet: Callable[[], AbstractContextManager[object]]) -> None:
    """Run Lightning's choice of ``fit``'s checkpoint path inside ``quiet()`` when the Trainer
    holds a ``callback_type`` (logs.quiet_auto_resume_warnings: its warnings about "last"
    checkpoints are raised there, before any hook runs). Other Trainers are left alone.

    Private: ``_CheckpointConnector._parse_ckpt_path`` (Lightning 2.5-2.6), called with the
    Trainer's state already set. Without it the warnings are shown.
    """
    _QUIET_CHOICE.setdefault(callback_type, quiet)

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def parse(self: Any, *args: Any, **kwargs: Any) -> Any:
            trainer = self.trainer
            fitting = getattr(trainer.state, "fn", None) == "fit"  # TrainerFn is a str enum
            callbacks = list(getattr(trainer, "callbacks", []))
            for callback_type, quiet in _QUIET_CHOICE.items():
                if fitting and any(isinstance(cb, callback_type) for cb in callbacks):
                    with quiet():
                        return original(self, *args, **kwargs)
            return original(self, *args, **kwargs)

        return parse

    wrap_once("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector",
               "_parse_ckpt_path", wrap)  # fmt: skip


# ---- the training loop's data (exact resume, lightning/exact.py) --------------------------
# Lightning 2.5-2.6: FitLoop keeps the CombinedLoader in `_combined_loader` and the fetcher
# in `_data_fetcher`; the CombinedLoader's mode iterator holds one iterator per loader in
# `_iterator.iterators`; the training epoch loop keeps `self.log` results in `_results`.
def train_loaders(trainer: Any) -> list[Any]:
    """The training dataloaders as Lightning iterates them (after its sampler injection)."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


def train_fetcher(trainer: Any) -> Any | None:
    """The training data fetcher; ``iter()`` on it remakes every loader's iterator."""
    return getattr(trainer.fit_loop, "_data_fetcher", None)


def train_loader_iterators(trainer: Any) -> list[Any] | None:
    """The live iterator of each training loader (``None`` if Lightning holds them elsewhere)."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    mode_iterator = getattr(combined, "_iterator", None)
    iterators = getattr(mode_iterator, "iterators", None)
    return list(iterators) if iterators is not None else None


def train_reload_due(trainer: Any) -> bool:
    """Lightning will reload the training loaders at the next epoch start
    (``reload_dataloaders_every_n_epochs``). Private: ``FitLoop._should_reload_train_dl``."""
    fit_loop = trainer.fit_loop
    return getattr(fit_loop, "_combined_loader", None) is not None and bool(
        getattr(fit_loop, "_should_reload_train_dl", False)
    )


def reload_train_data(trainer: Any) -> None:
    """Reload the training loaders now: ``FitLoop.setup_data`` makes them and their iterator
    and notes the epoch, so the epoch start does not reload them again."""
    trainer.fit_loop.setup_data()


def training_results(trainer: Any) -> Any | None:
    """The running ``self.log`` results of the training epoch (a ``_ResultCollection``)."""
    return getattr(trainer.fit_loop.epoch_loop, "_results", None)


def refresh_train_batches(trainer: Any) -> None:
    """Count the training batches per epoch again (Lightning counts them once, at set-up, in
    ``FitLoop.setup_data``) after a resharded epoch's loaders changed length, and when that
    epoch is over: the limits, ``max_batches`` and ``val_check_batch``, as Lightning does."""
    from lightning.fabric.utilities.data import sized_len
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    if combined is None or getattr(combined, "limits", None) is None:
        return
    lengths = [sized_len(dl) for dl in combined.flattened]
    limits = [
        _parse_num_batches(RunningStage.TRAINING, n if n is not None else float("inf"), trainer.limit_train_batches)
        for n in lengths
    ]
    combined.limits = limits
    if getattr(combined, "_iterator", None) is not None:
        combined._iterator.limits = limits
    length = sized_len(combined)
    if length is None:
        return
    trainer.fit_loop.max_batches = length
    interval = getattr(trainer, "val_check_interval", None)
    if isinstance(interval, float) and getattr(trainer, "check_val_every_n_epoch", None) is not None:
        trainer.val_check_batch = max(1, int(length * interval))


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Lightning's own per-epoch ``set_epoch`` call on a loader's samplers."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(loader, epoch)


# ---- a resume target chosen after Lightning chose "no checkpoint" -------------------------
def restore_late(trainer: Any, path: str) -> None:
    """Load ``path`` for this ``fit`` although Lightning's ``ckpt_path`` was ``None`` (a job
    that waited for the lease resumes what the previous holder committed meanwhile).

    Lightning's next ``resume_start(None)`` (in ``_restore_modules_and_callbacks``, after
    set-up, or after the strategy's own set-up for FSDP/DeepSpeed) loads ``path`` instead:
    the load is collective, and a rank whose own peek saw the checkpoint loads it at that
    very point. Private: ``trainer._checkpoint_connector.resume_start`` (Lightning 2.5-2.6);
    without it a clear error says to restart rather than train from step 0 silently.
    """
    connector: Any = getattr(trainer, "_checkpoint_connector", None)
    resume_start = getattr(connector, "resume_start", None)
    if resume_start is None:  # pragma: no cover - moved in a newer Lightning
        from lightning_preempt.errors import CheckpointError

        raise CheckpointError(
            "a checkpoint was committed to dirpath while this job waited for the lease, and this Lightning "
            "version cannot load it this late",
            path=path,
            hint="Restart the job: it then resumes from that checkpoint.",
        )

    def once(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
        del connector.resume_start  # the class's own again
        return resume_start(checkpoint_path or path, *args, **kwargs)

    connector.resume_start = once


# ---- fit's set-up, once its callbacks are final (checkpoint_io: the plugin alone warns) ----
_AT_FIT_SETUP: list[Callable[[Any], None]] = []


def at_fit_setup(check: Callable[[Any], None]) -> None:
    """Call ``check(trainer)`` at every ``fit``'s set-up, once the model's
    ``configure_callbacks`` are attached (``_CallbackConnector._attach_model_callbacks``,
    wrapped): ``trainer.callbacks`` and ``trainer.strategy.checkpoint_io`` are the run's own
    then, and no hook of theirs has run. The plugin learns of no Trainer otherwise. Missing:
    no check runs (the plugin alone stays silent, as before)."""
    if check not in _AT_FIT_SETUP:
        _AT_FIT_SETUP.append(check)

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def _attach_model_callbacks(self: Any) -> None:
            original(self)
            if getattr(getattr(self.trainer, "state", None), "fn", None) == "fit":
                for each in _AT_FIT_SETUP:
                    each(self.trainer)

        return _attach_model_callbacks

    wrap_once("lightning.pytorch.trainer.connectors.callback_connector", "_CallbackConnector",
               "_attach_model_callbacks", wrap)  # fmt: skip


# ---- DDPStrategy: how it builds the DDP module ---------------------------------------------
def build_ddp_through(strategy: Any, build: Callable[[Any, Callable[[], Any]], Any]) -> bool:
    """Have ``strategy`` (a ``DDPStrategy``) build its DDP module as ``build(self, make)``,
    ``make()`` being Lightning's own construction. ``False`` (nothing done) where it has been
    done already or the strategy's class builds the module its own way (DeepSpeed).

    Private: ``DDPStrategy._setup_model`` (Lightning 2.5-2.6). Without it DDP is built as
    Lightning builds it (a 3-rank resume may then differ in the last bits: docs/exact-resume.md).
    """
    from lightning.pytorch.strategies import DDPStrategy

    original = getattr(DDPStrategy, "_setup_model", None)
    if original is None or not isinstance(strategy, DDPStrategy) or type(strategy)._setup_model is not original:
        return False
    if "_setup_model" in vars(strategy):
        return False

    def setup_model(model: Any) -> Any:
        return build(strategy, lambda: original(strategy, model))

    strategy._setup_model = setup_model  # type: ignore[method-assign]  # on the instance: other strategies and Trainers keep theirs
    return True


def tolerate_preempted_children(exit_code: int, wait_s: float) -> int:
    """Let Lightning's child-process observer accept a child's preemption exit.

    With the subprocess launcher (``devices=N`` without torchrun/SLURM) a thread of rank 0
    SIGKILLs every process once any child exits non-zero, so rank 0 was killed (-9) whenever a
    preempted rank left first: its logs, ledger record and exit code were lost. A child exiting
    with ``exit_code`` now gives the others ``wait_s`` to exit by themselves; any other code, or a
    process still running after that, gets Lightning's kill. Returns how many observers changed.

    Private: ``_ChildProcessObserver`` (``_run``, ``_child_processes``; Lightning 2.5-2.6).
    Without it nothing changes.
    """
    adapted = 0
    for thread in threading.enumerate():
        if type(thread).__name__ != "_ChildProcessObserver" or getattr(thread, "_lp_tolerant", False):
            continue
        run, children = getattr(thread, "_run", None), getattr(thread, "_child_processes", None)
        if run is None or children is None:
            continue
        first_seen: list[float] = []

        def tolerant(run: Callable[[], bool] = run, children: list[Any] = children,
                     first_seen: list[float] = first_seen) -> bool:  # fmt: skip
            codes = [child.poll() for child in children]
            if any(code not in (None, 0, exit_code) for code in codes) or exit_code not in codes:
                return run()  # a failure, or nothing preempted: Lightning's own decision
            first_seen[:1] = first_seen[:1] or [time.monotonic()]
            if time.monotonic() - first_seen[0] < wait_s:
                return False  # keep watching: this process exits by itself (the thread is a daemon)
            return run()  # still running after the wait: Lightning's kill

        thread._run = tolerant  # type: ignore[attr-defined]
        thread._lp_tolerant = True  # type: ignore[attr-defined]
        adapted += 1
    return adapted


# ---- the optimizer inside Lightning's wrapper -------------------------------------------
def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a ``LightningOptimizer`` wraps (the optimizer itself otherwise).

    Private: ``LightningOptimizer._optimizer`` (Lightning 2.5-2.6), as Lightning's own
    strategies use it. Without it the object is returned as given.
    """
    return getattr(optimizer, "_optimizer", optimizer)
