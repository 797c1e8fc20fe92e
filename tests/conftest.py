"""Shared fixtures and the CI sampling of slow matrices."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

# The GCS emulator never answers gcsfs's gRPC bucket probe (each call would wait 60 s): tell
# gcsfs to skip it, before anything imports gcsfs. Subprocesses inherit it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))

# The `slow` tests run in a rotating sample unless LP_FULL=1: they are split into SAMPLE_EVERY
# slices and CI runs slice (UTC day number) % SAMPLE_EVERY, so each slow test runs at least
# once every SAMPLE_EVERY days of CI runs (1 in 3 took CI to 14m56s on 2 cores; 1 in 4 held
# it under its budget until issues 21-25 added 4x the slow tests: 1 in 7, one a day, does). LP_SLICE=k runs slice k (the header of a run names its slice, so a
# developer reproduces CI's choice with the same LP_SLICE). A test named by its node id on
# the command line (`file.py::test`) always runs: scripts/test_min_versions.sh picks its own.
SAMPLE_EVERY = int(os.environ.get("LP_SAMPLE_EVERY", "7"))
if not 1 <= SAMPLE_EVERY <= 7:
    raise pytest.UsageError(f"LP_SAMPLE_EVERY={SAMPLE_EVERY}: every slow test must run within a week (1..7)")


def _slice_today() -> int:
    return int(time.time() // 86400) % SAMPLE_EVERY


def slices(items: list[pytest.Item]) -> dict[str, int]:
    """The slice of each slow test: a file's slow tests, in collection order, take the slices
    in turn from a stable hash of the file name on, so each file spreads over the slices and
    every day costs about the same. Computed over whole files (before -k/-m), so running one
    file picks the same tests as the full suite does."""
    by_file: dict[str, list[str]] = {}
    for item in items:
        if item.get_closest_marker("slow") is not None:
            by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item.nodeid)
    out = {}
    for file, nodeids in by_file.items():
        start = int(hashlib.sha1(file.encode()).hexdigest(), 16)
        out.update({nodeid: (start + i) % SAMPLE_EVERY for i, nodeid in enumerate(nodeids)})
    return out


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
    chosen = os.environ["LP_SLICE"]
    return (
        f"slow tests: slice {chosen} of 0..{SAMPLE_EVERY - 1} (today's is {_slice_today()}); "
        f"reproduce with LP_SLICE={chosen} LP_SAMPLE_EVERY={SAMPLE_EVERY}, or run all with LP_FULL=1"
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
    if os.environ.get("LP_FULL") == "1":
        return
    chosen = int(os.environ["LP_SLICE"])
    slice_of = slices(items)
    named = _named(config)
    keep, drop = [], []
    for item in items:
        runs = (
            item.get_closest_marker("slow") is None
            or slice_of[item.nodeid] == chosen
            or item.nodeid in named
            or item.nodeid.split("[", 1)[0] in named
        )
        (keep if runs else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    # `gpu` tests (tests/gpu/, scripts/gpu_check.sh) run where CUDA is; elsewhere they skip.
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA (run scripts/gpu_check.sh on a GPU machine)")


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
