"""The notice sources' HTTP helper: plain ``http.client``, bounded in time and size (``urllib``
honours ``HTTP_PROXY``, and a metadata server must be reached directly).
"""

from __future__ import annotations

import dataclasses
import http.client
import socket
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

MAX_BODY = 1 << 20  # metadata answers are tiny; more than this is garbage, not a notice


class GarbageResponse(ValueError):
    """The server answered, but not in the documented format."""


# Everything that means "this request failed" (and never a bug of ours): the poller
# catches exactly these, logs once and backs off.
REQUEST_FAILURES: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException, GarbageResponse)


class _DeadlineSocket(socket.socket):
    """A socket whose every read and write ends by one ``deadline``: a socket timeout bounds
    each read, not the request, and a server trickling bytes (slow-loris) would hold it for ever."""

    deadline = 0.0

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request ran past its time bound")
        self.settimeout(left)
        return left

    def recv_into(self, *args: object, **kwargs: object) -> int:  # type: ignore[override]
        self._left()
        return super().recv_into(*args, **kwargs)  # type: ignore[arg-type]

    def recv(self, *args: object, **kwargs: object) -> bytes:  # type: ignore[override]
        self._left()
        return super().recv(*args, **kwargs)  # type: ignore[arg-type]

    def sendall(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        self._left()
        super().sendall(*args, **kwargs)  # type: ignore[arg-type]


class _BoundedConnection(http.client.HTTPConnection):
    """``HTTPConnection`` whose whole exchange (connect, send, headers, body) ends by ``deadline``."""

    def __init__(self, host: str, port: int, deadline: float) -> None:
        super().__init__(host, port, timeout=max(0.001, deadline - time.monotonic()))
        self.deadline = deadline

    def connect(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request ran past its time bound")
        raw = socket.create_connection((self.host, self.port), left)
        bounded = _DeadlineSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
        bounded.deadline = self.deadline
        self.sock = bounded


@dataclasses.dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]  # lower-case names
    body: bytes

    @property
    def text(self) -> str:
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError as err:
            raise GarbageResponse(f"HTTP {self.status} body is not UTF-8") from err


def request(
    method: str,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    timeout_s: float,
) -> Response:
    """One request, no proxy, no redirects; ``timeout_s`` bounds the whole exchange (connect,
    send, status line, headers, body), not just each read (:class:`_DeadlineSocket`)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(
            f"metadata endpoint must be an http:// URL, got {url!r}\n"
            "HINT: e.g. 'http://169.254.169.254' (the default) or 'http://127.0.0.1:8080' for a fake server."
        )
    conn = _BoundedConnection(parts.hostname, parts.port or 80, time.monotonic() + timeout_s)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(method, target, body=body, headers=dict(headers or {}))
        resp = conn.getresponse()
        data = resp.read(MAX_BODY + 1)
        if len(data) > MAX_BODY:
            raise GarbageResponse(f"HTTP {resp.status} body larger than {MAX_BODY} bytes")
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


def join(endpoint: str, path: str) -> str:
    """``http://host:port`` + ``/path?query`` (an endpoint may carry a trailing slash)."""
    return endpoint.rstrip("/") + path
