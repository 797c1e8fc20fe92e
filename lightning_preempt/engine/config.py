"""Validated configuration: a bad argument fails at construction with a HINT, not one
save interval (or one preemption) later.

:class:`PreemptionConfig` holds every option of :class:`PreemptionCallback`; the callback
keeps its plain keyword signature (LightningCLI reads it) and builds one of these. The
``check_*`` helpers are shared with the plugin's options.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from collections.abc import Sequence
from typing import Any, Literal

from lightning_preempt.preemption.signals import resolve_signal

# SIGKILL and SIGSTOP cannot be caught; the others would stop the process for reasons
# that are not a preemption (a crash, a debugger).
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}
_NOT_PREEMPTION = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT, signal.SIGTRAP}


def _fail(name: str, value: Any, want: str, hint: str) -> ValueError:
    return ValueError(f"{name} must be {want}, got {value!r}\nHINT: {hint}")


def check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None, optional: bool = False,
              hint: str = "") -> int | None:  # fmt: skip
    """An int in ``[minimum, maximum]`` (``None`` allowed when ``optional``); bools are refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, f"an int >= {minimum}" + (" or None" if optional else ""), hint or f"e.g. {name}={minimum}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise _fail(name, value, f"an int {bounds}", hint or f"e.g. {name}={minimum}")
    return int(value)


def check_seconds(name: str, value: Any, *, positive: bool = True, optional: bool = False, hint: str = "") -> float | None:
    """A finite number of seconds, > 0 (or >= 0 with ``positive=False``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, value, "a finite number of seconds" + (" or None" if optional else ""), hint or f"e.g. {name}=30")
    if value < 0 or (positive and value == 0):
        raise _fail(name, value, "> 0" if positive else ">= 0", hint or f"e.g. {name}=30")
    return float(value)


def check_str_tuple(name: str, value: Any, *, hint: str) -> tuple[str, ...]:
    """A non-empty sequence of strings; a bare string is refused (it would be split into characters)."""
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise _fail(name, value, "a non-empty list of strings", hint)
    if not all(isinstance(v, str) and v for v in value):
        raise _fail(name, value, "a list of non-empty strings", hint)
    return tuple(value)


def check_signals(value: Any) -> tuple[signal.Signals, ...]:
    """Resolve signal names eagerly; only catchable signals that can mean "preempted"."""
    hint = "e.g. signals=('SIGTERM',) or ('SIGUSR1', 'SIGTERM') (SIGKILL cannot be caught)."
    if isinstance(value, (str, int, signal.Signals)) or not isinstance(value, Sequence) or not value:
        raise _fail("signals", value, "a non-empty list of signal names", hint)
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (str, int, signal.Signals)):
            raise _fail("signals", value, "signal names such as 'SIGTERM'", hint)
        try:
            sig = resolve_signal(item)
        except ValueError as err:
            raise _fail("signals", value, "known signal names", hint) from err
        if sig in _UNCATCHABLE or sig in _NOT_PREEMPTION:
            raise _fail("signals", value, "signals that can be caught and mean 'preempted'", hint)
        out.append(sig)
    return tuple(dict.fromkeys(out))


def check_plugin_options(
    *,
    storage_options: Any,
    pin_memory: Any,
    thread_count: Any,
    verify_on_load: Any,
    sharded_keys: Any,
    drain_workers: Any,
    drain_retries: Any,
    drain_backoff_s: Any,
    trust_checkpoints: Any,
) -> None:
    """Validate :class:`~lightning_preempt.ShardedAsyncCheckpointIO`'s options (raises ``ValueError``)."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise _fail("storage_options", storage_options, "a dict or None", "e.g. storage_options={'token': 'anon'}")
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise _fail("pin_memory", pin_memory, "True, False or None", "None pins when CUDA is available.")
    for name, value in (("verify_on_load", verify_on_load), ("trust_checkpoints", trust_checkpoints)):
        if not isinstance(value, bool):
            raise _fail(name, value, "True or False", f"e.g. {name}={name == 'verify_on_load'}")
    check_int("thread_count", thread_count, minimum=1, hint="writer threads per rank, e.g. thread_count=1.")
    check_str_tuple("sharded_keys", sharded_keys, hint="e.g. sharded_keys=('state_dict', 'optimizer_states').")
    check_int("drain_workers", drain_workers, minimum=1, hint="files uploaded in parallel, e.g. 4.")
    check_int("drain_retries", drain_retries, minimum=1, hint="attempts per drain, e.g. 4 (1 = no retry).")
    check_seconds("drain_backoff_s", drain_backoff_s, positive=False, hint="the first retry delay, e.g. 1.0.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    """Every option of :class:`~lightning_preempt.PreemptionCallback`, validated.

    See the callback's docstring for what each one means.
    """

    dirpath: str
    every_n_train_steps: int | None = None
    every_n_seconds: float | None = None
    keep_last_n: int = 2
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)
    grace_period_s: float = 30.0
    exit_code: int = 143
    requeue: bool | None = None
    requeue_timeout_s: float = 10.0
    agree_every_n_steps: int | Literal["auto"] = "auto"
    agree_interval_s: float = 0.25
    overlap_agreement: bool = True
    resume: bool = True
    save_on_train_end: bool = True
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    local_dirpath: str | None = None
    list_retries: int = 4
    list_backoff_s: float = 1.0
    lease: bool = True
    lease_timeout_s: float = 60.0
    probe_storage: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.dirpath, str) or not self.dirpath.strip():
            raise _fail("dirpath", self.dirpath, "a directory or URL", "e.g. dirpath='checkpoints/' or 'gs://bucket/run'.")
        check_int("every_n_train_steps", self.every_n_train_steps, minimum=1, optional=True,
                  hint="pass None to disable step-based saves.")  # fmt: skip
        check_seconds("every_n_seconds", self.every_n_seconds, optional=True, hint="pass None to disable time-based saves.")
        check_int("keep_last_n", self.keep_last_n, minimum=1, hint="keep at least the newest checkpoint.")
        object.__setattr__(self, "signals", check_signals(self.signals))
        check_seconds("grace_period_s", self.grace_period_s,
                      hint="the scheduler's time between SIGTERM and SIGKILL, e.g. 30.")  # fmt: skip
        check_int("exit_code", self.exit_code, minimum=1, maximum=255,
                  hint="a non-zero code the scheduler reads as a preemption, e.g. 143 (128 + SIGTERM).")  # fmt: skip
        if self.requeue is not None and not isinstance(self.requeue, bool):
            raise _fail("requeue", self.requeue, "True, False or None", "None requeues whenever SLURM_JOB_ID is set.")
        check_seconds("requeue_timeout_s", self.requeue_timeout_s)
        if self.agree_every_n_steps != "auto":
            check_int("agree_every_n_steps", self.agree_every_n_steps, minimum=1,
                      hint="'auto' keeps the agreement cost near 1% of a step with bounded latency.")  # fmt: skip
        check_seconds("agree_interval_s", self.agree_interval_s)
        for name in ("overlap_agreement", "resume", "save_on_train_end", "lease", "probe_storage"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "True or False", f"e.g. {name}=True")
        if not isinstance(self.storage_options, dict):
            raise _fail("storage_options", self.storage_options, "a dict", "e.g. storage_options={'token': 'anon'}")
        if self.local_dirpath is not None and (not isinstance(self.local_dirpath, str) or not self.local_dirpath):
            raise _fail("local_dirpath", self.local_dirpath, "a local directory or None", "e.g. '/local_nvme/ckpt'.")
        check_int("list_retries", self.list_retries, minimum=1)
        check_seconds("list_backoff_s", self.list_backoff_s, positive=False)
        check_seconds("lease_timeout_s", self.lease_timeout_s)

def local_dirpath_from_env(value: str | None) -> str | None:
    """Expand ``~`` and environment variables (``$SLURM_TMPDIR/ckpt``) in ``local_dirpath``."""
    if value is None:
        return None
    return os.path.expandvars(os.path.expanduser(str(value)))
