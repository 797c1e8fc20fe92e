"""What every cloud notice source shares: one bounded HTTP request, daemon watcher threads,
backoff, one WARNING. Requests use plain ``http.client`` (``urllib`` honours ``HTTP_PROXY``,
and a metadata server must be reached directly). :meth:`MetadataSource.poll` never blocks;
any exception of one answer counts as a failed request (a parser broken unforeseen must not
end the watcher and miss a later notice).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

from lightning_preempt._text import untrusted_text
from lightning_preempt.preemption.sources import Notice

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"  # the link-local address all three clouds use
MAX_BODY = 1 << 20  # metadata answers are tiny; more than this is garbage, not a notice

# A watcher checks once (or long-polls once) and returns a notice or None. It may block
# (bounded by its own timeouts); it gets the stop event to end a wait early.
Watcher = Callable[[threading.Event], "Notice | None"]


class GarbageResponse(ValueError):
    """The server answered, but not in the documented format."""


# Everything that means "this request failed" (and never a bug of ours): the poller
# catches exactly these, logs once and backs off.
REQUEST_FAILURES: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException, GarbageResponse)


class _DeadlineSocket(socket.socket):
    """A socket whose every read and write ends by one ``deadline``: a socket timeout bounds
    each read, not the request, and a server trickling bytes (slow-loris) would hold it for ever."""

    deadline = 0.0

    def _left(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request ran past its time bound")
        self.settimeout(left)

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


def json_object(body: str, what: str) -> dict[str, object]:
    """``body`` as a JSON object; :class:`GarbageResponse` otherwise."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as err:  # RecursionError: '[[[[…' nested past the C stack
        raise GarbageResponse(f"{what} is not JSON: {body[:200]!r}") from err
    if not isinstance(doc, dict):
        raise GarbageResponse(f"{what} is not a JSON object: {body[:200]!r}")
    return doc


def wall_to_monotonic(wall: float) -> float:
    """A ``time.time()`` instant as ``time.monotonic()`` (deadlines are compared to monotonic)."""
    return time.monotonic() + (wall - time.time())


def parse_iso8601(text: str) -> float:
    """``2017-09-18T08:22:00Z`` (AWS) → epoch seconds; :class:`GarbageResponse` otherwise."""
    try:
        stamp = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except (ValueError, AttributeError) as err:
        raise GarbageResponse(f"not an ISO 8601 time: {text!r}") from err
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)  # IMDS times are UTC
    return stamp.timestamp()


def parse_http_date(text: str) -> float:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` (Azure ``NotBefore``) → epoch seconds."""
    try:
        return parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError, IndexError) as err:
        raise GarbageResponse(f"not an HTTP date: {text!r}") from err


class MetadataSource:
    """Base for the cloud sources: subclasses set :attr:`name` and give :meth:`watchers` (a
    daemon thread each). A notice with a deadline ends its watcher and replaces an advisory
    one, so :meth:`poll` returns the most definite announcement seen."""

    name = "metadata"
    #: Environment variables that name the endpoint when none is given (first set wins).
    endpoint_env: tuple[str, ...] = ()

    def __init__(
        self, endpoint: str | None, *, interval_s: float, timeout_s: float, max_backoff_s: float = 60.0
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(
                f"interval_s and timeout_s must be positive, got {interval_s!r} and {timeout_s!r}\n"
                "HINT: the defaults (seconds) suit the real metadata servers."
            )
        value = endpoint or next((os.environ[n] for n in self.endpoint_env if os.environ.get(n)), DEFAULT_ENDPOINT)
        # a bare ``host[:port]`` (as ``GCE_METADATA_HOST`` holds) gets ``http://`` in front
        self.endpoint = (value if "://" in value else f"http://{value}").rstrip("/")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max(max_backoff_s, interval_s)
        self.failures = 0  # consecutive, over all watchers (for logs and tests)
        self.requests_failed = 0  # total
        self._notice: Notice | None = None
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._threads: list[threading.Thread] = []
        self._warned = False

    def __getstate__(self) -> dict[str, object]:
        # A callback is pickled for ddp_spawn: threads and locks stay behind (not started there).
        return {**self.__dict__, "_lock": None, "_stop": None, "_threads": []}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ---- PreemptionSource --------------------------------------------------------------
    def start(self) -> None:
        """Start the watcher threads (again after :meth:`stop`); returns at once."""
        if self._stop is not None and not self._stop.is_set():
            return  # already running
        stop = threading.Event()  # per start: an old thread still in a long-poll sees its own
        self._stop = stop
        self._warned = False
        self._threads = [
            threading.Thread(target=self._run, args=(w, stop), name=f"lightning_preempt-{self.name}-{i}", daemon=True)
            for i, w in enumerate(self.watchers())
        ]
        for t in self._threads:
            t.start()

    def poll(self) -> Notice | None:
        return self._notice  # one attribute read: never blocks the training thread

    def stop(self) -> None:
        """Ask the threads to end; does not wait for a long-poll in flight (daemon threads)."""
        if self._stop is not None:
            self._stop.set()

    # ---- for subclasses ----------------------------------------------------------------
    def watchers(self) -> list[Watcher]:
        raise NotImplementedError

    def request(self, method: str, path: str, headers: Mapping[str, str], *, timeout_s: float | None = None,
                body: bytes | None = None) -> Response:  # fmt: skip
        """:func:`request` of ``path`` on this source's endpoint (``timeout_s``: :attr:`timeout_s`)."""
        return request(method, self.endpoint + path, headers=headers, body=body, timeout_s=timeout_s or self.timeout_s)

    def backoff_s(self, failures: int) -> float:
        """The pause after ``failures`` consecutive failures: exponential, capped (a vanished
        server is asked rarely, not never: it may come back)."""
        return min(self.max_backoff_s, self.interval_s * 2 ** min(failures, 16))

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    # ---- the loop ----------------------------------------------------------------------
    def _run(self, watch: Watcher, stop: threading.Event) -> None:
        failures = 0
        while not stop.is_set():
            try:
                notice = watch(stop)
            except Exception as err:  # REQUEST_FAILURES, and whatever a malformed answer raises
                failures += 1
                self._failed(err, failures)
                stop.wait(self.backoff_s(failures))
                continue
            if failures:
                log.info("lightning_preempt: the %s metadata server at %s answers again", self.name, self.endpoint)
                failures = self.failures = 0
            if notice is not None and not stop.is_set():
                self._record(notice)
                if notice.deadline is not None:
                    return  # definite: the node goes; nothing more to watch for
            stop.wait(self.interval_s)

    def _failed(self, err: BaseException, failures: int) -> None:
        self.failures = failures
        self.requests_failed += 1
        what = untrusted_text(err)  # an exception's text may quote the server's bytes
        if not self._warned:
            self._warned = True
            hint = (
                f"off that cloud, drop {self.name!r} from `notices`; on it, check that the metadata server is "
                "reachable from the container (host network / hop limit)."
                if isinstance(err, REQUEST_FAILURES)
                else "the answer broke the parser (a hostile server, or a bug of ours: please report it)."
            )
            log.warning(
                "lightning_preempt: %s notices: the metadata server at %s failed (%s: %s); retrying with backoff, "
                "training is not affected\nHINT: %s",
                self.name, self.endpoint, type(err).__name__, what, hint,
            )  # fmt: skip
        else:
            log.debug("lightning_preempt: %s notices: request failed again (%s: %s)", self.name, type(err).__name__, what)

    def _record(self, notice: Notice) -> None:
        with self._lock:
            current = self._notice
            if current is not None and (current.deadline is not None or notice.deadline is None):
                return  # keep the first, unless an advisory one is now made definite
            self._notice = notice
        left = f"; {notice.deadline - time.monotonic():.0f}s left" if notice.deadline is not None else ""
        # The reason quotes the server (an event id, a status): escaped, so it cannot start a line of its own.
        log.warning("lightning_preempt: [notice] %s: %s%s", notice.source, untrusted_text(notice.reason), left)


class NoopSource:
    """What a local rank other than 0 gets: rank 0 of its node watches for it, and the
    notice reaches this rank through the all-rank agreement."""

    def __init__(self, name: str) -> None:
        self.name = f"{name} (watched by local rank 0)"

    def start(self) -> None:
        pass

    def poll(self) -> Notice | None:
        return None

    def stop(self) -> None:
        pass
