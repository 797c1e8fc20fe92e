"""A fake cloud metadata server on 127.0.0.1: the subset of AWS IMDSv2, GCE and Azure IMDS
that the notice sources use, with a reclaim announced when a test says so.

A real HTTP server (stdlib ``ThreadingHTTPServer`` on a thread), so the sources run their
real request code. Besides answering correctly it can misbehave on demand: ``mode``
``"slow"`` holds every request until :meth:`FakeMetadata.release` (or ``stop``),
``"garbage"`` answers 200 with junk, ``"junk"`` answers bytes that are not HTTP,
``"error"`` answers 500; :meth:`stop` makes it vanish (connection refused afterwards).

Also runnable on its own for the end-to-end tests' subprocesses and for trying a job by
hand: ``python tests/fake_metadata.py --port 8080`` (then type commands, see ``--help``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import sys
import threading
import time
from collections import Counter
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

AWS_TOKEN = "/latest/api/token"
AWS_ACTION = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
GCE = "/computeMetadata/v1/instance/"
AZURE_EVENTS = "/metadata/scheduledevents"
AZURE_NAME = "/metadata/instance/compute/name"
AZURE_INSTANCE = "/metadata/instance"


def _iso(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


class FakeMetadata:
    """One server; ``clouds`` limits which protocols it speaks (others get 404)."""

    def __init__(self, clouds: tuple[str, ...] = ("aws", "gce", "azure"), *, vm_name: str = "vm0") -> None:
        self.clouds = clouds
        self.vm_name = vm_name
        self.mode = "ok"
        self.requests: Counter[tuple[str, str]] = Counter()  # (method, path) -> count
        self.log: list[tuple[str, str, dict[str, str]]] = []  # (method, path?query, headers)
        self.acks: list[dict[str, Any]] = []
        self.held = 0  # requests currently held ("slow" mode or a GCE long-poll)
        self.peak_held = 0
        self.released_by_change = 0  # GCE long-polls answered because the value changed
        self._tokens: set[str] = set()
        self._aws_action: dict[str, str] | None = None
        self._aws_rebalance: dict[str, str] | None = None
        self._gce = {"preempted": "FALSE", "maintenance-event": "NONE"}
        self._azure_events: list[dict[str, Any]] = []
        self._raw: dict[tuple[str, str], tuple[int, bytes]] = {}  # (method, path) -> a hostile answer
        self._incarnation = 1
        self._cond = threading.Condition()
        self._release = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # ---- life cycle --------------------------------------------------------------------
    def start(self, port: int = 0) -> FakeMetadata:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = _Server(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Vanish: stop answering and close the socket (new connections are refused)."""
        if self._server is None:
            return
        self._release.set()
        with self._cond:
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    def __enter__(self) -> FakeMetadata:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_mode(self, mode: str) -> None:
        """``"ok"``, ``"slow"`` (hold requests until :meth:`release`), ``"garbage"``, ``"junk"``, ``"error"``."""
        if mode == "slow":
            self._release.clear()
        self.mode = mode
        if mode != "slow":
            self.release()

    def release(self) -> None:
        """Let the requests held in ``"slow"`` mode go (they then answer normally)."""
        self._release.set()
        with self._cond:
            self._cond.notify_all()

    def count(self, path: str, method: str = "GET") -> int:
        return self.requests[(method, path)]

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> None:
        """Bounded poll of the server's own state (no sleeps as synchronisation)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("fake metadata server: condition not reached in time")
                self._cond.wait(min(left, 0.05))

    # ---- announcements -----------------------------------------------------------------
    def announce_aws(self, action: str = "terminate", in_s: float = 120.0) -> None:
        self._set(lambda: setattr(self, "_aws_action", {"action": action, "time": _iso(time.time() + in_s)}))

    def announce_aws_rebalance(self) -> None:
        self._set(lambda: setattr(self, "_aws_rebalance", {"noticeTime": _iso(time.time())}))

    def announce_gce(self, key: str = "preempted", value: str = "TRUE") -> None:
        self._set(lambda: self._gce.__setitem__(key, value))

    def announce_azure(
        self,
        event_type: str = "Preempt",
        in_s: float = 30.0,
        resources: list[str] | None = None,
        status: str = "Scheduled",
    ) -> str:
        event_id = f"EVT-{len(self._azure_events) + 1:04d}"
        event = {
            "EventId": event_id,
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": resources if resources is not None else [self.vm_name],
            "EventStatus": status,
            "NotBefore": formatdate(time.time() + in_s, usegmt=True),
            "Description": "fake",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }
        self._set(lambda: self._azure_events.append(event))
        return event_id

    def serve_raw(self, method: str, path: str, body: bytes | None, status: int = 200) -> None:
        """Answer ``method path`` with exactly ``body`` (a malformed document, a bad token)
        until called again with ``body=None``."""
        self._set(lambda: self._raw.pop((method, path), None) if body is None else self._raw.__setitem__((method, path), (status, body)))

    def revoke_tokens(self) -> None:
        """AWS: every issued token now gets 401 (as after its TTL)."""
        self._set(self._tokens.clear)

    def _set(self, change: Any) -> None:
        with self._cond:
            change()
            self._incarnation += 1
            self._cond.notify_all()

    # ---- answers (called by the handler) -----------------------------------------------
    def answer(self, h: _Handler) -> None:
        parts = urlsplit(h.path)
        path, query = parts.path, {k: v[-1] for k, v in parse_qs(parts.query).items()}
        with self._cond:
            self.requests[(h.command, path)] += 1
            self.log.append((h.command, h.path, {k.lower(): v for k, v in h.headers.items()}))
            self._cond.notify_all()
        if self.mode == "slow":
            self._hold(lambda: self._release.is_set())
        if self.mode == "junk":
            h.wfile.write(b"\x00\xffthis is not HTTP\r\n\r\n")
            return
        if self.mode == "garbage":
            return h.reply(200, b"<html>\x00\x01 not what you expected \xff</html>")
        if self.mode == "error":
            return h.reply(500, b"internal error")
        if (h.command, path) in self._raw:
            return h.reply(*self._raw[(h.command, path)])
        if "aws" in self.clouds and path.startswith("/latest/"):
            return self._aws(h, path)
        if "gce" in self.clouds and path.startswith(GCE):
            return self._gce_answer(h, path[len(GCE) :], query)
        if "azure" in self.clouds and path.startswith("/metadata/"):
            return self._azure(h, path)
        h.reply(404, b"not found")

    def _hold(self, done: Any, timeout: float | None = None) -> bool:
        with self._cond:
            self.held += 1
            self.peak_held = max(self.peak_held, self.held)
            self._cond.notify_all()
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._cond:
                while not done() and self._server is not None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(0.05 if left is None else min(left, 0.05))
                return done()
        finally:
            with self._cond:
                self.held -= 1
                self._cond.notify_all()

    def _aws(self, h: _Handler, path: str) -> None:
        if path == AWS_TOKEN:
            if h.command != "PUT" or not h.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return h.reply(400 if h.command == "PUT" else 405, b"")
            token = hashlib.sha1(f"{time.monotonic_ns()}".encode()).hexdigest()
            with self._cond:
                self._tokens.add(token)
            return h.reply(200, token.encode())
        if h.headers.get("X-aws-ec2-metadata-token") not in self._tokens:
            return h.reply(401, b"")
        doc = {AWS_ACTION: self._aws_action, AWS_REBALANCE: self._aws_rebalance}.get(path)
        if doc is None:
            return h.reply(404, b"")
        h.reply(200, json.dumps(doc).encode())

    def _gce_answer(self, h: _Handler, key: str, query: dict[str, str]) -> None:
        if h.headers.get("Metadata-Flavor") != "Google":
            return h.reply(403, b"Missing Metadata-Flavor:Google header.")
        if key not in self._gce:
            return h.reply(404, b"")

        def etag() -> str:
            return hashlib.sha1(self._gce[key].encode()).hexdigest()[:16]

        if query.get("wait_for_change") == "true" and query.get("last_etag") == etag():
            changed = self._hold(lambda: etag() != query["last_etag"], float(query.get("timeout_sec", "60")))
            if changed:
                with self._cond:
                    self.released_by_change += 1
        h.reply(200, self._gce[key].encode(), {"ETag": etag(), "Metadata-Flavor": "Google"})

    def _azure(self, h: _Handler, path: str) -> None:
        if h.headers.get("Metadata") != "true":
            return h.reply(400, b'{"error": "Bad request. Required metadata header not specified"}')
        if path == AZURE_NAME:
            return h.reply(200, self.vm_name.encode())
        if path == AZURE_INSTANCE:
            return h.reply(200, json.dumps({"compute": {"name": self.vm_name}}).encode())
        if path != AZURE_EVENTS:
            return h.reply(404, b"")
        if h.command == "POST":
            length = int(h.headers.get("Content-Length", "0"))
            with self._cond:
                self.acks.append(json.loads(h.rfile.read(length) or b"{}"))
                self._cond.notify_all()
            return h.reply(200, b"")
        doc = {"DocumentIncarnation": self._incarnation, "Events": self._azure_events}
        h.reply(200, json.dumps(doc).encode())


class _Handler(BaseHTTPRequestHandler):
    fake: FakeMetadata
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.fake.answer(self)

    do_PUT = do_POST = do_GET

    def reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # a client gave up
            super().handle_error(request, client_address)


def refused_url() -> tuple[str, socket.socket]:
    """A loopback URL whose port is bound but not listening (connections are refused).
    Keep the returned socket open while the URL is in use."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return f"http://127.0.0.1:{s.getsockname()[1]}", s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--clouds", default="aws,gce,azure")
    args = p.parse_args()
    fake = FakeMetadata(tuple(args.clouds.split(","))).start(args.port)
    print(f"listening {fake.url}", flush=True)
    # Commands on stdin, one a line: aws [action] [in_s] | rebalance | gce [key] [value] |
    # azure [type] [in_s] | mode ok|slow|garbage|junk|error | stop
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "aws":
            fake.announce_aws(*(rest[:1] or ["terminate"]), *(float(x) for x in rest[1:2]))
        elif cmd == "rebalance":
            fake.announce_aws_rebalance()
        elif cmd == "gce":
            fake.announce_gce(*rest[:2])
        elif cmd == "azure":
            fake.announce_azure(*(rest[:1] or ["Preempt"]), *(float(x) for x in rest[1:2]))
        elif cmd == "mode":
            fake.set_mode(rest[0])
        elif cmd == "stop":
            break
        print(f"ok {cmd}", flush=True)
    fake.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
