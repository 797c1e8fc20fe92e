"""Shared fixtures and the CI sampling of slow matrices."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

import pytest

# The GCS emulator never answers gcsfs's gRPC bucket probe (each call would wait 60 s): tell
# gcsfs to skip it, before anything imports gcsfs. Subprocesses inherit it.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))

# One case in SAMPLE_EVERY of the `slow` tests runs unless LP_FULL=1 (CI, min-versions job included,
# measured 14m56s on 2 cores with 1 in 3; 1 in 4 keeps it well under 15 min).
SAMPLE_EVERY = int(os.environ.get("LP_SAMPLE_EVERY", "4"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("LP_FULL") == "1":
        return
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("slow") is None:
            keep.append(item)
            continue
        digest = int(hashlib.sha1(item.nodeid.encode()).hexdigest(), 16)
        (keep if digest % SAMPLE_EVERY == 0 else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
