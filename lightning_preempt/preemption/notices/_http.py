"""The one HTTP helper the notice sources use: plain ``http.client``, bounded in time and size.

Why not ``urllib``: it honours ``HTTP_PROXY``/``http_proxy``, and a metadata server must be
reached directly (a proxy would answer for *its* host, or not at all). Why not
``requests``: not a dependency, and four verbs on loopback/link-local need nothing more.
"""

from __future__ import annotations

import dataclasses
import http.client
from collections.abc import Mapping
from urllib.parse import urlsplit

MAX_BODY = 1 << 20  # metadata answers are tiny; more than this is garbage, not a notice


class GarbageResponse(ValueError):
    """The server answered, but not in the documented format."""


# Everything that means "this request failed" (and never a bug of ours): the poller
# catches exactly these, logs once and backs off.
REQUEST_FAILURES: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException, GarbageResponse)


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
    """One request, no proxy, no redirects; ``timeout_s`` bounds connect and each read."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(
            f"metadata endpoint must be an http:// URL, got {url!r}\n"
            "HINT: e.g. 'http://169.254.169.254' (the default) or 'http://127.0.0.1:8080' for a fake server."
        )
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
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
