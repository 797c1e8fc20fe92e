"""Pytest fixtures for object-store tests (GCS emulator, moto S3) on 127.0.0.1.

Use from a test module with ``pytest_plugins = ["objectstore_plugin"]``. The servers
are session-scoped (started on first use, stopped at the end); every test gets its own
prefix in the bucket, removed afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import servers  # sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false before gcsfs can be imported


@dataclasses.dataclass
class Remote:
    """A fresh prefix on one object store: ``url`` plus the fsspec ``storage_options``."""

    scheme: str
    url: str
    storage_options: dict[str, Any]
    server: servers.Server

    def join(self, *parts: str) -> str:
        return "/".join([self.url, *[p.strip("/") for p in parts]])


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[servers.Server]:
    pytest.importorskip("gcsfs")
    server = servers.start_gcs()
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    servers.point_gcsfs_at(server)
    try:
        yield server
    finally:
        server.stop()
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous


@pytest.fixture(scope="session")
def s3_server() -> Iterator[servers.Server]:
    pytest.importorskip("s3fs")
    server = servers.start_s3()
    try:
        yield server
    finally:
        server.stop()


def _prefix(request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _remote(server: servers.Server, request: pytest.FixtureRequest) -> Iterator[Remote]:
    scheme = "gs" if server.name == "gcs" else "s3"
    remote = Remote(scheme, server.url(_prefix(request)), dict(server.storage_options), server)
    yield remote
    if server.alive:
        import fsspec

        with contextlib.suppress(Exception):
            fs, path = fsspec.core.url_to_fs(remote.url, **remote.storage_options)
            fs.invalidate_cache()
            fs.rm(path, recursive=True)


@pytest.fixture
def gs_remote(gcs_server: servers.Server, request: pytest.FixtureRequest) -> Iterator[Remote]:
    yield from _remote(gcs_server, request)


@pytest.fixture
def s3_remote(s3_server: servers.Server, request: pytest.FixtureRequest) -> Iterator[Remote]:
    yield from _remote(s3_server, request)


@pytest.fixture(params=["gs", "s3"])
def remote(request: pytest.FixtureRequest) -> Remote:
    """Each test using it runs once against GCS and once against S3."""
    return request.getfixturevalue(f"{request.param}_remote")  # type: ignore[no-any-return]
