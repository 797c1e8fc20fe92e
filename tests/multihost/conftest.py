"""The multi-host tests' hosts: network namespaces (tests/support/netns.py)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Hosts, missing


@pytest.fixture
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    """Two "hosts" for one test (``parametrize("hosts", [n], indirect=True)``: n); skips with
    one line where namespaces are not available."""
    why = missing()
    if why is not None:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    h = Hosts(getattr(request, "param", 2))
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def memory() -> Iterator[Path]:
    """The nodes' tier-0 memories, in the machine's tmpfs (removed afterwards)."""
    path = Path("/dev/shm") / f"lp-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
