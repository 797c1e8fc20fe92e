"""Shared fixtures and the CI sampling of slow matrices."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The GCS emulator never answers gcsfs's gRPC bucket probe (each call would wait 60 s): tell
# gcsfs to skip it, before anything imports gcsfs. Subprocesses inherit it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))

# The `slow` tests run in a rotating, cost-balanced sample unless LP_FULL=1. Their measured
# cost (worker-seconds, tests/slow_costs.json, refreshed by scripts/slow_costs.py) splits them
# into PERIOD slices of about equal cost (longest first, each onto the cheapest slice so far),
# PERIOD being the fewest days whose slices fit the budget (LP_SLOW_BUDGET worker-seconds, the
# table's "budget_s" by default; at most 10: every slow test runs at least once in 10 days). CI runs
# slice (UTC day number) % PERIOD. The split is computed from the table alone, so running one
# file picks the same tests as the whole suite; a slow test not in the table yet takes a slice
# by a hash of its node id (and the table's default cost in the header's figure). LP_SLICE=k runs
# slice k (the run names its slice: a developer reproduces CI's choice with the same LP_SLICE);
# LP_SAMPLE_EVERY=n forces n slices. A test named by its node id on the command line
# (`file.py::test`) always runs: scripts/test_min_versions.sh picks its own.
COSTS_FILE = Path(__file__).resolve().parent / "slow_costs.json"
_COSTS = json.loads(COSTS_FILE.read_text())
SLOW_COSTS: dict[str, float] = _COSTS["slow"]
FAST_COSTS: dict[str, float] = _COSTS.get("fast", {})
DEFAULT_COST = float(_COSTS["default_s"])
BUDGET = float(os.environ.get("LP_SLOW_BUDGET", _COSTS["budget_s"]))
MAX_PERIOD = 10


def _period() -> int:
    if "LP_SAMPLE_EVERY" in os.environ:
        return int(os.environ["LP_SAMPLE_EVERY"])
    return max(1, min(MAX_PERIOD, math.ceil(sum(SLOW_COSTS.values()) / BUDGET)))


SAMPLE_EVERY = _period()
if not 1 <= SAMPLE_EVERY <= MAX_PERIOD:
    raise pytest.UsageError(
        f"LP_SAMPLE_EVERY={SAMPLE_EVERY}: every slow test runs within {MAX_PERIOD} days (1..{MAX_PERIOD})"
    )


def _hash(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest(), 16)


def _slice_today() -> int:
    return int(time.time() // 86400) % SAMPLE_EVERY


def balanced_slices(costs: dict[str, float], n: int) -> dict[str, int]:
    """Longest processing time first: each test, the costliest first (ties by a hash of its
    node id), goes to the slice with the least cost so far (ties: the lowest index)."""
    load = [0.0] * n
    out = {}
    for nodeid in sorted(costs, key=lambda t: (-costs[t], _hash(t))):
        k = min(range(n), key=lambda i: (load[i], i))
        out[nodeid] = k
        load[k] += costs[nodeid]
    return out


_SLICE_OF = balanced_slices(SLOW_COSTS, SAMPLE_EVERY)


def slice_of(nodeid: str) -> int:
    return _SLICE_OF[nodeid] if nodeid in _SLICE_OF else _hash(nodeid) % SAMPLE_EVERY


def slice_cost(k: int) -> float:
    return sum(c for t, c in SLOW_COSTS.items() if _SLICE_OF[t] == k)


def cost(nodeid: str) -> float:
    """Measured worker-seconds of a test (0 for a fast test under the table's threshold)."""
    return SLOW_COSTS.get(nodeid, FAST_COSTS.get(nodeid, 0.0))


def pytest_configure(config: pytest.Config) -> None:
    # Decided once, here: pytest-xdist workers inherit the environment, so every worker
    # samples the same slice even when a run crosses midnight UTC.
    if os.environ.get("LP_FULL") != "1":
        os.environ.setdefault("LP_SLICE", str(_slice_today()))
    chosen = int(os.environ.get("LP_SLICE", "0"))
    if not 0 <= chosen < SAMPLE_EVERY:
        raise pytest.UsageError(f"LP_SLICE={chosen} is not a slice of 0..{SAMPLE_EVERY - 1} (LP_SAMPLE_EVERY)")


def _which_slow_tests() -> str:
    if os.environ.get("LP_FULL") == "1":
        return "slow tests: all (LP_FULL=1)"
    chosen = int(os.environ["LP_SLICE"])
    return (
        f"slow tests: slice {chosen} of 0..{SAMPLE_EVERY - 1} (today's is {_slice_today()}), "
        f"~{slice_cost(chosen):.0f} worker-s of {BUDGET:.0f} (tests/slow_costs.json); "
        f"reproduce with LP_SLICE={chosen}"
        + (f" LP_SAMPLE_EVERY={SAMPLE_EVERY}" if "LP_SAMPLE_EVERY" in os.environ else "")
        + ", or run all with LP_FULL=1"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return _which_slow_tests()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # Also at the end: `-q` (scripts/test.sh, CI) hides the header.
    terminalreporter.write_line(_which_slow_tests())


def _named(config: pytest.Config) -> set[str]:
    """Node ids given on the command line (``path::test[param]``), relative to the rootdir."""
    named = set()
    for arg in config.args:
        if "::" in arg:
            path, _, rest = arg.partition("::")
            with contextlib.suppress(ValueError):  # (outside the rootdir: as given)
                path = Path(path).resolve().relative_to(config.rootpath).as_posix()
            named.add(f"{path}::{rest}")
    return named


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect anything: slices count whole files
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Longest first (scripts/test.sh: `--dist load --maxschedchunk 1` hands each worker the
        # next test when it is free): a 60 s test started last would run alone at the end.
        # Only the tests the table names move; the rest keep their order (module fixtures).
        items.sort(key=lambda item: -cost(item.nodeid))
    if os.environ.get("LP_FULL") == "1":
        return
    chosen = int(os.environ["LP_SLICE"])
    named = _named(config)
    keep, drop = [], []
    for item in items:
        runs = (
            item.get_closest_marker("slow") is None
            or slice_of(item.nodeid) == chosen
            or item.nodeid in named
            or item.nodeid.split("[", 1)[0] in named
        )
        (keep if runs else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


_RECORDED: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # LP_RECORD_COSTS=file: each test's setup+call+teardown seconds, one JSON line a test, for
    # scripts/slow_costs.py to refresh tests/slow_costs.json (under xdist the controller writes).
    out = os.environ.get("LP_RECORD_COSTS")
    if not out or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _RECORDED[report.nodeid] = _RECORDED.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        line = {"nodeid": report.nodeid, "seconds": round(_RECORDED.pop(report.nodeid), 2)}
        line["slow"] = "slow" in report.keywords
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_runtest_setup(item: pytest.Item) -> None:
    # `gpu` tests (tests/gpu/, scripts/gpu_check.sh) run where CUDA is; elsewhere they skip.
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA (run scripts/gpu_check.sh on a GPU machine)")


@pytest.fixture(autouse=True)
def _nothing_left_running() -> Iterator[None]:
    """The jobs, agents and workers a test started and left running (a failure or an interrupt
    half-way) are SIGKILLed with their process groups once its fixtures are torn down; a
    watchdog does the same when this process is gone (tests/support/reaper.py)."""
    import reaper

    reaper.begin_test()
    yield
    reaper.end_test()


#: What Lightning's in-process launchers (``ddp_spawn``, Fabric's fork) set in this process for good.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _launch_environment_restored() -> Iterator[None]:
    """Each test leaves the launch variables as it found them: an in-process ``ddp_spawn`` test
    left ``MASTER_PORT`` in the xdist worker, a later test's jobs inherited it, and two of them
    then listened on one port (EADDRINUSE, a hang). Only these: the servers' fixtures set
    variables meant to outlive a test (``STORAGE_EMULATOR_HOST``)."""
    saved = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


#: The signals a preemption handler takes over (lightning_preempt/preemption/signals.py).
_PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


def _handlers() -> dict[str, Any]:
    import signal

    return {name: signal.getsignal(getattr(signal, name)) for name in _PREEMPTION_SIGNALS}


#: The handlers this process started with, before any test.
_PRISTINE_HANDLERS = _handlers()


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Each test ends with the signal handlers the process started with: a finished in-process
    fit or Fabric loop keeps a late-signal handler (a real process exits soon after), and a later
    test's own SIGUSR1 then reached it ("SIGUSR1 after training ended") instead of that test's
    callback. (The process's first handlers, not the test's: a handler another test left would
    otherwise be put back after every test, and chained by the next controller.)"""
    import signal

    yield
    for name, handler in _PRISTINE_HANDLERS.items():
        if handler is not None:
            signal.signal(getattr(signal, name), handler)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory of its own in /dev/shm (a tmpfs: tier 0's home), removed afterwards."""
    root = Path(f"/dev/shm/lp-test-{uuid.uuid4().hex[:8]}")
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def tmp_url(tmp_path: Path) -> str:
    return str(tmp_path / "ckpts")


@pytest.fixture
def memory_url(request: pytest.FixtureRequest) -> str:
    import fsspec

    url = f"memory://lp-tests/{request.node.name}"
    fs = fsspec.filesystem("memory")
    with contextlib.suppress(FileNotFoundError):
        fs.rm(url, recursive=True)
    yield url
    with contextlib.suppress(FileNotFoundError):
        fs.rm(url, recursive=True)


@pytest.fixture
def slurm_cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A private one-node SLURM cluster (tests/support/slurm.py, docs/slurm-testing.md):
    ``low`` and ``high`` partitions, preemption by partition priority with REQUEUE, GraceTime
    20 s; skips with how to install SLURM where its programs are absent."""
    import slurm

    absent = slurm.missing()
    if absent:
        pytest.skip(f"{', '.join(absent)} not found. {slurm.HOW_TO_GET}")
    with slurm.cluster(tmp_path / "slurm") as cluster:
        yield cluster
