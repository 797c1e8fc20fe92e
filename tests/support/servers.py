"""Local object-store servers for tests: the GCS emulator and moto's S3 server.

Both bind to 127.0.0.1 on a free port; nothing here contacts any other address. Each
server runs as a child process in its own process group, so :meth:`Server.stop` (or
:meth:`Server.kill`, to simulate an outage mid-upload) ends it and only it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import reaper

HOST = "127.0.0.1"
GCS_BUCKET = "lp-test-bucket"
S3_BUCKET = "lp-test-bucket"
START_TIMEOUT_S = 30.0

# gcsfs >= 2026 probes every bucket over gRPC unless this is false *before* it is imported
# (against the emulator each operation would wait out a 60 s timeout).
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# Never route loopback traffic through a proxy.
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = ",".join(filter(None, [os.environ.get(_var, ""), HOST, "localhost"]))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"{name} not found\nHINT: pip install the test extras (moto[s3], flask, flask-cors, gcp-storage-emulator)."
        )
    return found


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclasses.dataclass
class Server:
    """One running server process."""

    name: str
    endpoint: str
    bucket: str
    process: subprocess.Popen[bytes]
    log_path: str
    storage_options: dict[str, Any]

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def url(self, *parts: str) -> str:
        """``gs://bucket/a/b`` or ``s3://bucket/a/b``."""
        scheme = "gs" if self.name == "gcs" else "s3"
        return "/".join([f"{scheme}://{self.bucket}", *[p.strip("/") for p in parts]])

    def kill(self) -> None:
        """SIGKILL the server (simulated outage)."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        reaper.untrack(self.process.pid)
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    fd, log_path = tempfile.mkstemp(prefix=f"lp-{name}-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    reaper.track(proc.pid, per_test=False)  # a module's server: its fixture stops it, or the watchdog
    return proc, log_path


def _wait_ready(server: Server, probe: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive:
            raise RuntimeError(f"{server.name} server exited during start-up:\n{server.log_tail()}")
        try:
            with _OPENER.open(probe, timeout=2) as resp:
                resp.read()
                return
        except urllib.error.HTTPError:
            return  # it answered: it is up
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"{server.name} server not ready after {timeout_s:.0f}s:\n{server.log_tail()}")


def start_gcs(bucket: str = GCS_BUCKET) -> Server:
    """gcp-storage-emulator, in memory, with ``bucket`` created."""
    port = free_port()
    argv = [
        _bin("gcp-storage-emulator"),
        "start",
        "--host",
        HOST,
        "--port",
        str(port),
        "--in-memory",
        "--default-bucket",
        bucket,
        "--quiet",
    ]
    proc, log_path = _spawn("gcs", argv)
    endpoint = f"http://{HOST}:{port}"
    server = Server("gcs", endpoint, bucket, proc, log_path, {"token": "anon", "project": "lp-test"})
    _wait_ready(server, f"{endpoint}/storage/v1/b/{bucket}")
    return server


def start_s3(bucket: str = S3_BUCKET) -> Server:
    """moto's S3 server with ``bucket`` created (no region: see FINDINGS)."""
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    proc, log_path = _spawn("s3", [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)], env)
    endpoint = f"http://{HOST}:{port}"
    options = {"endpoint_url": endpoint, "key": "x", "secret": "y", "client_kwargs": {"region_name": "us-east-1"}}
    server = Server("s3", endpoint, bucket, proc, log_path, options)
    _wait_ready(server, f"{endpoint}/moto-api/")
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    with _OPENER.open(req, timeout=10) as resp:
        resp.read()
    return server


def point_gcsfs_at(server: Server) -> None:
    """gcsfs reads ``STORAGE_EMULATOR_HOST`` on every request: point it at ``server``."""
    os.environ["STORAGE_EMULATOR_HOST"] = server.endpoint
