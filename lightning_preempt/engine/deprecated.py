"""The spellings of 0.2 that keep working for one release (CHANGELOG, "Deprecated"): each maps
to its new place with a ``FutureWarning`` (shown to end users by default) that names it.
Remove this module, and the fronts' ``**deprecated``, in the next release."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

from lightning_preempt.engine.config import CheckpointIOConfig, PreemptionConfig, Tuning, own_fields


def callback_names(
    *, signals: Any = None, exit_code: Any = None, requeue: Any = None, agree_every_n_steps: Any = None,
    overlap_agreement: Any = None, save_on_train_end: Any = None, lease: Any = None, lease_timeout_s: Any = None,
    probe_storage: Any = None, on_notice: Any = None, global_batch: Any = None, ledger: Any = None,
    log_metrics: Any = None, detect_failures: Any = None, heartbeat_timeout_s: Any = None,
    failure_exit_code: Any = None, memory_dirpath: Any = None, list_retries: Any = None, list_backoff_s: Any = None,
    sources: Any = None, requeue_timeout_s: Any = None, agree_interval_s: Any = None, **unknown: Any,
) -> dict[str, Any]:
    """The 0.2 names the callback still takes, those given (``None``: not given, which is each
    one's 0.2 default or no valid value), and any ``unknown``. Named in a signature so that
    LightningCLI (jsonargparse follows the callback's ``**deprecated`` here) reads a 0.2 YAML too."""
    given = {k: v for k, v in locals().items() if k != "unknown" and v is not None}
    return {**given, **unknown}


def plugin_names(
    *, thread_count: Any = None, pinned_memory_budget: Any = None, overlap_staging: Any = None,
    drain_retries: Any = None, drain_backoff_s: Any = None, pin_memory: Any = None, local_dirpath: Any = None,
    drain_workers: Any = None, sharded_keys: Any = None, **unknown: Any,
) -> dict[str, Any]:
    """The 0.2 names the plugin still takes, as :func:`callback_names`."""
    given = {k: v for k, v in locals().items() if k != "unknown" and v is not None}
    return {**given, **unknown}


_RENAMED = {"list_retries": "retries", "list_backoff_s": "backoff_s", "drain_retries": "retries",
            "drain_backoff_s": "backoff_s", "pin_memory": "pinned_memory_budget"}  # fmt: skip
_SPECIAL = {"sources", "local_dirpath", "requeue_timeout_s", "agree_interval_s", "drain_workers", "sharded_keys"}
#: Old option (of the callback and ``fabric.Preemption``; of the plugin) -> its :class:`Tuning` field.
FRONT_TO_TUNING = {n: _RENAMED.get(n, n) for n in inspect.signature(callback_names).parameters if n not in
                   (*_SPECIAL, "unknown")}  # fmt: skip
PLUGIN_TO_TUNING = {n: _RENAMED.get(n, n) for n in inspect.signature(plugin_names).parameters if n not in
                    (*_SPECIAL, "unknown")}  # fmt: skip
#: Old options that became constants: why each no longer has an effect.
FIXED = {
    "requeue_timeout_s": "the requeue waits at most 10 s (and never past the grace period)",
    "agree_interval_s": "with agree_every_n_steps='auto' a signal waits at most 0.3 s (or 2 steps)",
    "drain_workers": "a drain uploads 4 files in parallel per rank",
    "sharded_keys": "Lightning's 'state_dict' and 'optimizer_states' go to the shards (fabric.save: its modules "
                    "and optimizers)",
}


def _warn(message: str) -> None:
    warnings.warn(f"lightning_preempt: {message}", FutureWarning, stacklevel=4)


def _unknown(owner: str, name: str, cls: type[Tuning]) -> TypeError:
    return TypeError(f"{owner}() got an unexpected keyword argument {name!r}\nHINT: its options are "
                     f"{', '.join(own_fields(cls))} and tuning=Tuning(...) (docs/options.md).")  # fmt: skip


def front(owner: str, options: dict[str, Any], tuning: Tuning | None, old: dict[str, Any]) -> PreemptionConfig:
    """The config of the callback's (or ``fabric.Preemption``'s) ``options`` and ``tuning``, with
    the old spellings in ``old`` mapped (``owner`` names the front-end in the messages)."""
    changes: dict[str, Any] = {}
    for name, value in old.items():
        if name == "sources":
            _warn(f"{owner}(sources=...) is deprecated; pass the sources in notices=[...] (with any names)")
            options["notices"] = (*_as_tuple(options.get("notices")), *value)
        elif not _moved(owner, name, value, FRONT_TO_TUNING, changes):
            raise _unknown(owner, name, PreemptionConfig)
        if name == "memory_dirpath" and value is not None and options.get("tier0_every_n_steps") is None:
            options["tier0_every_n_steps"] = "auto"  # 0.2: a tier-0 directory turned tier 0 on
    return PreemptionConfig.make(_with(tuning, changes), **options)


def plugin(tuning: Tuning | None, old: dict[str, Any]) -> tuple[Tuning | None, str | None]:
    """The plugin's ``tuning`` with the old spellings in ``old`` mapped, and its old ``local_dirpath``."""
    owner, changes, local_dirpath = "ShardedAsyncCheckpointIO", dict[str, Any](), None
    for name, value in old.items():
        if name == "local_dirpath":
            _warn(f"{owner}(local_dirpath=...) is deprecated; use PreemptionCallback(local_dirpath=...), which "
                  "hands it to the plugin")  # fmt: skip
            local_dirpath = value
        elif name == "pin_memory":
            _warn(f"{owner}(pin_memory=...) is deprecated; use {owner}(tuning=Tuning(pinned_memory_budget=...)) "
                  "(0: pin nothing; None: pin when CUDA is available)")  # fmt: skip
            if value is False:
                changes["pinned_memory_budget"] = 0
            elif value is not None and not isinstance(value, bool):
                raise ValueError(f"pin_memory must be True, False or None, got {value!r}\n"
                                 "HINT: use tuning=Tuning(pinned_memory_budget=0) to pin nothing.")  # fmt: skip
        elif not _moved(owner, name, value, PLUGIN_TO_TUNING, changes):
            raise _unknown(owner, name, CheckpointIOConfig)
    return _with(tuning, changes), local_dirpath


def _moved(owner: str, name: str, value: Any, to_tuning: dict[str, str], changes: dict[str, Any]) -> bool:
    """Warn about an old name that moved into ``Tuning`` (recorded in ``changes``) or became a
    constant; ``False`` for a name that is neither."""
    if name in to_tuning:
        _warn(f"{owner}({name}=...) is deprecated; use {owner}(tuning=Tuning({to_tuning[name]}=...))")
        changes[to_tuning[name]] = value
    elif name in FIXED:
        _warn(f"{owner}({name}=...) is deprecated and has no effect: {FIXED[name]}")
    else:
        return False
    return True


def _with(tuning: Tuning | None, changes: dict[str, Any]) -> Tuning | None:
    return dataclasses.replace(tuning or Tuning(), **changes) if changes else tuning


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)
