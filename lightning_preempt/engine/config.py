"""Validated configuration: a bad argument fails at construction with a HINT, not one
save interval (or one preemption) later.

One frozen dataclass per configurable object: :class:`PreemptionConfig` for the engine (and
so for :class:`~lightning_preempt.PreemptionCallback`), :class:`CheckpointIOConfig` for
:class:`~lightning_preempt.ShardedAsyncCheckpointIO`. The front-ends keep plain keyword
signatures (LightningCLI reads them) whose parameters are exactly these fields, with the
same defaults (tests/unit/test_config.py checks that they never drift apart), and build one
of these from their arguments. Normalisation (trailing slashes, ``~`` and ``$VARS`` in
``local_dirpath``, signal names) happens here, once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from lightning_preempt.preemption.notices import parse_names
from lightning_preempt.preemption.signals import resolve_signal
from lightning_preempt.staging.budget import check_budget
from lightning_preempt.storage.protocols import check_driver
from lightning_preempt.tiers.tier0 import default_memory_root

T = TypeVar("T")


def from_arguments(cls: type[T], arguments: dict[str, Any]) -> T:
    """``cls(**arguments)`` for the fields of the dataclass ``cls``: a front-end's ``__init__``
    passes its ``locals()`` (its parameters are exactly the config's fields)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in arguments.items() if k in names})


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    """Every option of :class:`~lightning_preempt.PreemptionCallback`, validated.

    What each one means: docs/options.md.
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
    agree_interval_s: float = 0.3
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
    notices: tuple[str, ...] = ()
    on_notice: Literal["continue", "exit"] = "continue"
    global_batch: Literal["per_rank", "keep"] = "per_rank"
    ledger: bool = True
    log_metrics: bool = True
    detect_failures: bool | None = None
    heartbeat_timeout_s: float = 4.0
    failure_exit_code: int = 75
    tier0_every_n_steps: int | Literal["auto"] | None = None
    memory_dirpath: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dirpath, os.PathLike):
            object.__setattr__(self, "dirpath", os.fspath(self.dirpath))
        if not isinstance(self.dirpath, str) or not self.dirpath.strip():
            raise _fail("dirpath", self.dirpath, "a directory or URL", "e.g. dirpath='checkpoints/' or 'gs://bucket/run'.")
        object.__setattr__(self, "dirpath", self.dirpath.rstrip("/") or self.dirpath)
        # a missing driver or a mistyped protocol: now, not at fit after the listing retries
        check_driver(self.dirpath, name="dirpath")
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
                      hint="'auto' agrees every step unless that costs over 0.5% of a step; a signal waits at most agree_interval_s.")  # fmt: skip
        check_seconds("agree_interval_s", self.agree_interval_s)
        for name in ("overlap_agreement", "resume", "save_on_train_end", "lease", "probe_storage", "ledger", "log_metrics"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "True or False", f"e.g. {name}=True")
        object.__setattr__(self, "storage_options", check_storage_options(self.storage_options))
        object.__setattr__(self, "local_dirpath", check_local_dirpath(self.local_dirpath))
        check_int("list_retries", self.list_retries, minimum=1)
        check_seconds("list_backoff_s", self.list_backoff_s, positive=False)
        check_seconds("lease_timeout_s", self.lease_timeout_s)
        if self.detect_failures is not None and not isinstance(self.detect_failures, bool):
            raise _fail("detect_failures", self.detect_failures, "True, False or None",
                        "None turns the heartbeats on whenever the job has more than one rank.")  # fmt: skip
        check_seconds("heartbeat_timeout_s", self.heartbeat_timeout_s,
                      hint="a rank silent this long is lost, e.g. 4 (survivors exit ~2 s after it).")  # fmt: skip
        check_int("failure_exit_code", self.failure_exit_code, minimum=1, maximum=255,
                  hint="a code the launcher restarts on and that differs from exit_code, e.g. 75.")  # fmt: skip
        if self.tier0_every_n_steps != "auto":
            check_int("tier0_every_n_steps", self.tier0_every_n_steps, minimum=1, optional=True,
                      hint="copy to host memory every K optimizer steps, 'auto' (K keeps the step-time overhead "
                           "within 1 %), or None for no tier 0 (docs/tier0.md).")  # fmt: skip
        memory = check_local_dirpath(self.memory_dirpath, name="memory_dirpath")
        if memory is None and self.tier0_every_n_steps is not None:
            memory = default_memory_root(self.dirpath)
        elif memory is not None and self.tier0_every_n_steps is None:
            object.__setattr__(self, "tier0_every_n_steps", "auto")  # a tier-0 directory given: tier 0 is on
        object.__setattr__(self, "memory_dirpath", memory)
        object.__setattr__(self, "notices", tuple(parse_names(self.notices)))  # type: ignore[arg-type]
        if self.on_notice not in ("continue", "exit"):
            raise _fail("on_notice", self.on_notice, "'continue' or 'exit'", "'continue' snapshots and trains on "
                        "until the signal; 'exit' snapshots and exits for requeue at once.")  # fmt: skip
        if self.global_batch not in ("per_rank", "keep"):
            raise _fail("global_batch", self.global_batch, "'per_rank' or 'keep'", "'per_rank' keeps each rank's batch "
                        "when the world size changes (the global batch follows it); 'keep' scales "
                        "accumulate_grad_batches to keep the global batch where it divides.")  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointIOConfig:
    """Every option of :class:`~lightning_preempt.ShardedAsyncCheckpointIO`, validated.

    See the plugin's docstring for what each one means.
    """

    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    pin_memory: bool | None = None
    host_memory_budget: int | float | None = None
    pinned_memory_budget: int | float | None = None
    thread_count: int = 1
    verify_on_load: bool = True
    sharded_keys: tuple[str, ...] = ("state_dict", "optimizer_states")
    local_dirpath: str | None = None
    drain_workers: int = 4
    drain_retries: int = 4
    drain_backoff_s: float = 1.0
    trust_checkpoints: bool = False
    overlap_staging: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage_options", check_storage_options(self.storage_options))
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise _fail("pin_memory", self.pin_memory, "True, False or None", "None pins when CUDA is available.")
        if self.overlap_staging is not None and not isinstance(self.overlap_staging, bool):
            raise _fail("overlap_staging", self.overlap_staging, "True, False or None",
                        "True copies parameters and optimizer state while the next step computes "
                        "(docs/staging.md); None chooses by device.")  # fmt: skip
        for name in ("host_memory_budget", "pinned_memory_budget"):
            check_budget(name, getattr(self, name))
        for name in ("verify_on_load", "trust_checkpoints"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, getattr(self, name), "True or False", f"e.g. {name}={name == 'verify_on_load'}")
        check_int("thread_count", self.thread_count, minimum=1, hint="writer threads per rank, e.g. thread_count=1.")
        object.__setattr__(self, "sharded_keys", check_str_tuple(
            "sharded_keys", self.sharded_keys, hint="e.g. sharded_keys=('state_dict', 'optimizer_states')."))  # fmt: skip
        object.__setattr__(self, "local_dirpath", check_local_dirpath(self.local_dirpath))
        check_int("drain_workers", self.drain_workers, minimum=1, hint="files uploaded in parallel, e.g. 4.")
        check_int("drain_retries", self.drain_retries, minimum=1, hint="attempts per drain, e.g. 4 (1 = no retry).")
        check_seconds("drain_backoff_s", self.drain_backoff_s, positive=False, hint="the first retry delay, e.g. 1.0.")


def check_storage_options(value: Any) -> dict[str, Any]:
    """A copy of a dict of fsspec options (``None``: no options)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail("storage_options", value, "a dict or None", "e.g. storage_options={'token': 'anon'}")
    return dict(value)


def check_local_dirpath(value: Any, name: str = "local_dirpath") -> str | None:
    """``None``, or a local directory with ``~`` and environment variables expanded
    (``$SLURM_TMPDIR/ckpt``), without a trailing slash."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise _fail(name, value, "a local directory or None", "e.g. '/local_nvme/ckpt'.")
    if "://" in value and not value.startswith("file://"):
        raise _fail(name, value, "a local directory", f"{name} is node-local (e.g. "
                    "'/local_nvme/ckpt'); the shared storage (gs://, s3://…) is dirpath.")  # fmt: skip
    expanded = os.path.expandvars(os.path.expanduser(value))
    return expanded.rstrip("/") or expanded
