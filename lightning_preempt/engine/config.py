"""Every option, written once: a frozen dataclass field with its meaning in the docstring
under it (docs/options.md is generated from these: ``python scripts/gen_options.py``).

* :class:`PreemptionConfig`: the common options of :class:`~lightning_preempt.PreemptionCallback`
  and ``fabric.Preemption`` (the fields written in its own body) plus every :class:`Tuning` field
  (inherited): the engine reads one flat, validated object.
* :class:`Tuning`: the knobs few runs need, passed as ``tuning=Tuning(...)`` to the callback (and
  the plugin it installs) or to :class:`~lightning_preempt.ShardedAsyncCheckpointIO`.
* :class:`CheckpointIOConfig`: the plugin's own options plus :class:`Tuning`.

A bad value fails at construction with a HINT, not one save interval (or one preemption)
later. Normalisation (trailing slashes, ``~`` and ``$VARS`` in local directories, signal
names) happens here, once. Old spellings: engine/deprecated.py.
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
from lightning_preempt.preemption.sources import PreemptionSource
from lightning_preempt.staging.budget import check_budget
from lightning_preempt.storage.protocols import check_driver
from lightning_preempt.tiers.tier0 import default_memory_root

C = TypeVar("C", bound="Tuning")

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



def _check_bools(obj: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise _fail(name, getattr(obj, name), "True or False", f"e.g. {name}={getattr(type(obj), name)!r}")


def _check_optional_bool(name: str, value: Any, hint: str) -> None:
    if value is not None and not isinstance(value, bool):
        raise _fail(name, value, "True, False or None", hint)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tuning:
    """The knobs few runs need, in one place: ``PreemptionCallback(..., tuning=Tuning(retries=8))``.

    The callback hands its ``tuning`` to the plugin it installs; a plugin you construct
    yourself reads its own (``ShardedAsyncCheckpointIO(tuning=...)``). In a LightningCLI YAML:
    ``tuning: {signals: [SIGUSR1, SIGTERM]}`` under the callback's ``init_args``.
    """

    signals: tuple[str | signal.Signals, ...] = ("SIGTERM",)
    """Signals that mean "preempted" (SLURM can send `SIGUSR1` earlier: `("SIGUSR1", "SIGTERM")`)."""
    exit_code: int = 143
    """Process exit code after a preemption (128 + SIGTERM), whatever the snapshot did (the log says which step is safe)."""
    requeue: bool | None = None
    """Run `scontrol requeue` on rank 0 as the last act before exiting (at most 10 s, within the grace period);
    `None`: whenever `SLURM_JOB_ID` is set (under `python -m lightning_preempt.torchrun` the agent of the reclaimed
    node requeues instead). `False` under SLURM: a preempted job is recorded `FAILED` ([recipes.md](recipes.md#slurm))."""
    agree_every_n_steps: int | Literal["auto"] = "auto"
    """How often ranks agree on the signal flag: every N optimizer steps (a signal then waits up to N + 1 steps), or
    `"auto"`: every step while timing the first 20 steps and the exchanges, then every step unless that costs over
    0.5% of a step, and never so rarely that a signal waits longer than 0.3 s, or 2 steps where a step is longer
    ([design.md](design.md#agreement-cost-and-latency))."""
    overlap_agreement: bool = True
    """Launch the agreement collective at a step's end and read it at the next step's end, while that step
    computes (hides its latency; a signal waits one step more)."""
    save_on_train_end: bool = True
    """Save the final step when training ends normally."""
    retries: int = 4
    """Attempts of a storage operation that may fail transiently: listing `dirpath` at start (never "start
    fresh" because a listing failed) and each two-tier drain."""
    backoff_s: float = 1.0
    """The first retry delay (doubles per attempt)."""
    lease: bool = True
    """Hold a lease on `dirpath` (`.lp-lease-*.json`) so a second live job cannot write into it."""
    lease_timeout_s: float = 60.0
    """A lease whose heartbeat has not advanced for this long is taken over."""
    probe_storage: bool = True
    """At `setup`, check that every rank can write, list and delete in `dirpath` (and `local_dirpath`) and fail
    before step 1 if not."""
    on_notice: Literal["continue", "exit"] = "continue"
    """`"continue"`: on a cloud notice, snapshot at the next agreed step and train on until the signal; `"exit"`:
    snapshot and exit with `exit_code` at once."""
    global_batch: Literal["per_rank", "keep"] = "per_rank"
    """At a resize (elastic runs): `"per_rank"` keeps each rank's batch, so the global batch follows the world size
    (logged); `"keep"` keeps the global batch by scaling `accumulate_grad_batches` by saved ranks / ranks now where
    that is a whole number (otherwise as `"per_rank"`) ([elastic.md](elastic.md)). A Fabric loop owns its own."""
    ledger: bool = True
    """Rank 0 records every start, save, preemption, agreed error and finish in `dirpath/.lp-ledger/` (small JSON
    files, off the training thread; a failed write only warns) for `lightning-preempt report`
    ([goodput.md](goodput.md))."""
    log_metrics: bool = True
    """Log each committed save's figures and the run's so far (preemptions, restarts, steps lost, goodput) through
    the Trainer's loggers (Fabric: `fabric.log_dict`), rank 0, no sync ([goodput.md](goodput.md#in-the-trainers-loggers))."""
    detect_failures: bool | None = None
    """Heartbeats between the ranks on a side channel (UDP): a rank or node lost without a signal is found within
    `heartbeat_timeout_s`; the survivors agree, record it in the ledger and exit with `failure_exit_code` for the
    launcher to restart. `None`: on whenever the job has more than one rank ([failure-detection.md](failure-detection.md))."""
    heartbeat_timeout_s: float = 4.0
    """A rank not heard from for this long is lost (survivors exit about 2 s later)."""
    failure_exit_code: int = 75
    """Every survivor's exit code after a loss (distinct from `exit_code`)."""
    memory_dirpath: str | None = None
    """Tier 0's directory (a tmpfs, the same path on every node), used when `tier0_every_n_steps` is set; `None`:
    `/dev/shm/lightning_preempt-<uid>/<dirpath's name>-<hash>`; private to this user ([security.md](security.md))."""
    thread_count: int = 1
    """Writer threads per rank (DCP serialisation is CPU-bound). Read by the plugin."""
    pinned_memory_budget: int | float | None = None
    """Of the staging buffers, the bytes that may be pinned (page-locked): bytes (int) or a fraction (float) of the
    host budget; `0`: pin nothing; `None`: all of it when CUDA is available. Read by the plugin
    ([host-memory.md](host-memory.md))."""
    overlap_staging: bool | None = None
    """With `PreemptionCallback`: a periodic save returns once buffers and small tensors are copied; parameters and
    optimizer state are copied while the next step's forward and backward run, and its optimizer step waits
    ([staging.md](staging.md)). `None`: off (on CPU it was a wash; on CUDA until the GPU check proves it). Read by the plugin."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", check_signals(self.signals))
        check_int("exit_code", self.exit_code, minimum=1, maximum=255,
                  hint="a non-zero code the scheduler reads as a preemption, e.g. 143 (128 + SIGTERM).")  # fmt: skip
        _check_optional_bool("requeue", self.requeue, "None requeues whenever SLURM_JOB_ID is set.")
        if self.agree_every_n_steps != "auto":
            check_int("agree_every_n_steps", self.agree_every_n_steps, minimum=1,
                      hint="'auto' agrees every step unless that costs over 0.5% of a step; a signal waits at most 0.3 s.")  # fmt: skip
        _check_bools(self, "overlap_agreement", "save_on_train_end", "lease", "probe_storage", "ledger", "log_metrics")
        check_int("retries", self.retries, minimum=1, hint="attempts, e.g. retries=4 (1 = no retry).")
        check_seconds("backoff_s", self.backoff_s, positive=False, hint="the first retry delay, e.g. backoff_s=1.0.")
        check_seconds("lease_timeout_s", self.lease_timeout_s)
        if self.on_notice not in ("continue", "exit"):
            raise _fail("on_notice", self.on_notice, "'continue' or 'exit'", "'continue' snapshots and trains on "
                        "until the signal; 'exit' snapshots and exits for requeue at once.")  # fmt: skip
        if self.global_batch not in ("per_rank", "keep"):
            raise _fail("global_batch", self.global_batch, "'per_rank' or 'keep'", "'per_rank' keeps each rank's batch "
                        "when the world size changes (the global batch follows it); 'keep' scales "
                        "accumulate_grad_batches to keep the global batch where it divides.")  # fmt: skip
        _check_optional_bool("detect_failures", self.detect_failures,
                             "None turns the heartbeats on whenever the job has more than one rank.")  # fmt: skip
        check_seconds("heartbeat_timeout_s", self.heartbeat_timeout_s,
                      hint="a rank silent this long is lost, e.g. 4 (survivors exit ~2 s after it).")  # fmt: skip
        check_int("failure_exit_code", self.failure_exit_code, minimum=1, maximum=255,
                  hint="a code the launcher restarts on and that differs from exit_code, e.g. 75.")  # fmt: skip
        object.__setattr__(self, "memory_dirpath", check_local_dirpath(self.memory_dirpath, name="memory_dirpath"))
        check_int("thread_count", self.thread_count, minimum=1, hint="writer threads per rank, e.g. thread_count=1.")
        if self.pinned_memory_budget != 0 or isinstance(self.pinned_memory_budget, bool):
            check_budget("pinned_memory_budget", self.pinned_memory_budget)
        _check_optional_bool("overlap_staging", self.overlap_staging, "True copies parameters and optimizer state "
                             "while the next step computes (docs/staging.md); None chooses by device.")  # fmt: skip

    @property
    def signums(self) -> tuple[signal.Signals, ...]:
        """:attr:`signals`, resolved (they are, after validation)."""
        return tuple(s for s in self.signals if isinstance(s, signal.Signals))

    @property
    def tuning(self) -> Tuning:
        """Only the :class:`Tuning` fields (of a config that also holds others)."""
        return Tuning(**_tuning_values(self))

    @classmethod
    def make(cls: type[C], tuning: Tuning | None = None, **options: Any) -> C:
        """The config of ``options`` (the fields ``cls`` adds) and ``tuning`` (default: its defaults)."""
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be a lightning_preempt.Tuning or None, got {type(tuning).__name__}\n"
                            "HINT: e.g. tuning=Tuning(retries=8); in a YAML, a mapping of its fields.")  # fmt: skip
        return cls(**options, **_tuning_values(tuning or Tuning()))


def _tuning_values(tuning: Tuning) -> dict[str, Any]:
    return {f.name: getattr(tuning, f.name) for f in dataclasses.fields(Tuning)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreemptionConfig(Tuning):
    """The common options of :class:`~lightning_preempt.PreemptionCallback` and ``fabric.Preemption``
    (below), and every :class:`Tuning` field, validated. Build it with :meth:`make`."""

    dirpath: str
    """Where checkpoints go: any fsspec URL (local path, `gs://`, `s3://`, `memory://`)."""
    every_n_train_steps: int | None = None
    """Save every N optimizer steps."""
    every_n_seconds: float | None = None
    """Save when this much wall time passed since the last save. Without either, the callback warns once at the
    start: only a preemption with a grace period (or the end) saves then."""
    keep_last_n: int = 2
    """Committed checkpoints to keep (older ones are deleted after a newer commit; retention never deletes another
    run's checkpoints)."""
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """fsspec options for `dirpath` (credentials, `endpoint_url`…); the callback hands them to the plugin."""
    local_dirpath: str | None = None
    """Two-tier mode: commit to this node-local directory first, drain to `dirpath` in the background; `~` and
    `$VARS` are expanded ([two-tier.md](two-tier.md))."""
    tier0_every_n_steps: int | Literal["auto"] | None = None
    """Tier 0: every K optimizer steps each rank also commits its share to host memory (`tuning.memory_dirpath`,
    outlives the process); a restart on the same host resumes from it when it is the newest valid checkpoint;
    newest kept; on several hosts also copied to the next node's memory and restored from there; `"auto"`: K from
    the measured overhead (<= 1 %); `None`: no tier 0 ([tier0.md](tier0.md))."""
    notices: tuple[str | PreemptionSource, ...] = ()
    """Preemption notices to watch: cloud names, any of `"aws"`, `"gce"`, `"azure"` (`"aws-interruption"`: AWS
    without rebalance recommendations) or `"auto"` (probe which metadata server answers), and your own
    `PreemptionSource` objects ([notices.md](notices.md)); a string may list names: `"aws,gce"`."""
    grace_period_s: float = 30.0
    """Time between the signal and SIGKILL; bounds the drain and requeue, and is used to warn when a snapshot is
    projected not to fit."""
    resume: bool = True
    """Resume from the newest valid checkpoint when `fit` gets no `ckpt_path` (an explicit `ckpt_path` always wins);
    with nothing to resume where an earlier run saved, every rank stops before step 1 (`ProgressWouldBeLostError`,
    [strategies](strategies.md#never-a-silent-fresh-start)); `False` starts over on purpose."""

    @property
    def notice_names(self) -> list[str]:
        return [n for n in self.notices if isinstance(n, str)]

    @property
    def sources(self) -> list[PreemptionSource]:
        return [s for s in self.notices if not isinstance(s, str)]

    def __post_init__(self) -> None:
        super().__post_init__()
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
        object.__setattr__(self, "storage_options", check_storage_options(self.storage_options))
        object.__setattr__(self, "local_dirpath", check_local_dirpath(self.local_dirpath))
        if self.tier0_every_n_steps != "auto":
            check_int("tier0_every_n_steps", self.tier0_every_n_steps, minimum=1, optional=True,
                      hint="copy to host memory every K optimizer steps, 'auto' (K keeps the step-time overhead "
                           "within 1 %), or None for no tier 0 (docs/tier0.md).")  # fmt: skip
        if self.tier0_every_n_steps is None and self.memory_dirpath is not None:
            raise _fail("tier0_every_n_steps", None, "set when tuning.memory_dirpath is", "tier 0 is on when "
                        "tier0_every_n_steps is set: e.g. tier0_every_n_steps='auto' (docs/tier0.md).")  # fmt: skip
        if self.tier0_every_n_steps is not None and self.memory_dirpath is None:
            object.__setattr__(self, "memory_dirpath", default_memory_root(self.dirpath))
        object.__setattr__(self, "notices", check_notices(self.notices))
        check_seconds("grace_period_s", self.grace_period_s,
                      hint="the scheduler's time between SIGTERM and SIGKILL, e.g. 30.")  # fmt: skip
        _check_bools(self, "resume")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointIOConfig(Tuning):
    """The options of :class:`~lightning_preempt.ShardedAsyncCheckpointIO` (below) and every
    :class:`Tuning` field (the plugin reads `thread_count`, `pinned_memory_budget`,
    `overlap_staging`, `retries` and `backoff_s`), validated."""

    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """fsspec options for every path, for the plugin without `PreemptionCallback` (docs/dropin.md); with the
    callback, give them to the callback: it hands them to the plugin."""
    host_memory_budget: int | float | None = None
    """The most host memory staging buffers may hold: bytes (int) or a fraction of `MemAvailable` (float in (0, 1]);
    `None`: half of `MemAvailable` divided by the node's ranks. A share over it keeps its smallest tensors in buffers
    and writes the rest before the save returns ([host-memory.md](host-memory.md))."""
    verify_on_load: bool = True
    """Check every file's CRC32C before loading."""
    trust_checkpoints: bool = False
    """Unpickle the non-tensor state with full `pickle` (`weights_only=False`), for states that keep arbitrary
    objects; only when you trust everyone who can write the storage ([security.md](security.md)).
    `load_checkpoint`'s `weights_only` overrides it for one load."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "storage_options", check_storage_options(self.storage_options))
        check_budget("host_memory_budget", self.host_memory_budget)
        _check_bools(self, "verify_on_load", "trust_checkpoints")


def own_fields(cls: type[Tuning]) -> list[str]:
    """The fields ``cls`` writes in its own body (not the inherited :class:`Tuning` ones), in order."""
    tuning = {f.name for f in dataclasses.fields(Tuning)}
    return [f.name for f in dataclasses.fields(cls) if f.name not in tuning or cls is Tuning]


def check_notices(value: Any) -> tuple[str | PreemptionSource, ...]:
    """Validated notice names (a comma-separated string splits) and source objects, in order."""
    items = [] if value is None else [value] if isinstance(value, (str, PreemptionSource)) else list(value)
    names = parse_names(",".join(n for n in items if isinstance(n, str)))
    for item in items:
        if not isinstance(item, (str, PreemptionSource)):
            raise TypeError(f"notices must be names or PreemptionSource objects, got {item!r}\n"
                            "HINT: e.g. notices=['aws'] or notices='auto' (docs/notices.md).")  # fmt: skip
    return (*names, *(s for s in items if isinstance(s, PreemptionSource)))


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
