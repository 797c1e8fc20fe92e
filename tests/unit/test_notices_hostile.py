"""Notice sources against a hostile or broken metadata server (real HTTP on 127.0.0.1).

A malformed answer must cost one failed request, never the watcher thread (a real notice
served later is still seen); a server that trickles its answer is cut at the request's
bound with a warning; a deadline far in the future is clamped; the server's text reaches
the log escaped.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_metadata import AWS_ACTION, AWS_TOKEN, AZURE_EVENTS, FakeMetadata
from log_records import package_records

from lightning_preempt._text import untrusted_text
from lightning_preempt.preemption.notices import AWSSpotSource, AzureSource
from lightning_preempt.preemption.notices.base import MetadataSource
from lightning_preempt.preemption.sources import MAX_NOTICE_HORIZON_S, Notice


def wait_until(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout}s")


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """Every record of our package logger at DEBUG and above, whatever the logging set-up."""
    with package_records(logging.DEBUG) as got:
        yield got


@pytest.fixture
def sources() -> Iterator[list[MetadataSource]]:
    started: list[MetadataSource] = []
    yield started
    for s in started:
        s.stop()


def _start(started: list[MetadataSource], source: MetadataSource) -> Any:
    source.max_backoff_s = 0.05  # a retry soon after each failure: the test stays short
    started.append(source)
    source.start()
    return source


def _deep(n: int = 100_000) -> bytes:
    return b"[" * n + b"]" * n  # json.loads: RecursionError, not ValueError


# (cloud, method, path, the malformed answer)
MALFORMED = [
    ("aws", "GET", AWS_ACTION, _deep()),
    ("aws", "PUT", AWS_TOKEN, b"tok\ren"),  # CR in a header value: http.client raises ValueError
    ("aws", "PUT", AWS_TOKEN, "tok\u2603en".encode()),  # not latin-1: UnicodeEncodeError
    ("azure", "GET", AZURE_EVENTS, _deep()),
]


@pytest.mark.parametrize(("cloud", "method", "path", "body"), MALFORMED, ids=["aws-deep-json", "aws-token-cr",
                         "aws-token-non-ascii", "azure-deep-json"])  # fmt: skip
def test_a_malformed_answer_costs_one_request_not_the_watcher(
    cloud: str, method: str, path: str, body: bytes, records: list[logging.LogRecord], sources: list[MetadataSource]
) -> None:
    with FakeMetadata((cloud,)) as fake:
        fake.serve_raw(method, path, body)
        cls = AWSSpotSource if cloud == "aws" else AzureSource
        src = _start(sources, cls(fake.url, interval_s=0.01, timeout_s=5.0))
        wait_until(lambda: src.failures >= 3, what="three failed answers")  # the thread is still polling
        assert src.running and src.poll() is None
        fake.serve_raw(method, path, None)  # the server recovers and announces a real reclaim
        fake.announce_aws() if cloud == "aws" else fake.announce_azure()
        notice = wait_until(src.poll, what=f"the {cloud} notice after malformed answers")
        assert notice.source == cloud and notice.deadline is not None
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING and "failed" in r.getMessage()]
    assert len(warned) == 1, warned  # logged once, then polled on
    assert "\r" not in warned[0] and "\u2603" not in warned[0]


class SlowLoris:
    """A real socket server that accepts and then trickles a never-ending status line, one
    byte per ``every_s``: each read gets data before any per-read timeout fires."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.every_s = every_s
        self.accepted = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                while not self._stop.wait(self.every_s):
                    conn.sendall(b"a")
            except OSError:
                return  # the client gave up: what the test wants

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


def test_a_slow_loris_server_is_cut_at_the_request_bound_with_a_warning(
    records: list[logging.LogRecord], sources: list[MetadataSource]
) -> None:
    server = SlowLoris()
    try:
        src = _start(sources, AWSSpotSource(server.url, interval_s=0.01, timeout_s=0.5))
        # Without a bound on the whole request the first one never ends: no second connection.
        wait_until(lambda: server.accepted >= 3 and src.failures >= 2, what="requests cut and retried")
        assert src.running
        warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "TimeoutError" in warned[0] and "training is not affected" in warned[0]
    finally:
        server.close()


def _azure_events(event_id: str, not_before: str) -> bytes:
    event = {"EventId": event_id, "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": ["vm0"],
             "EventStatus": "Scheduled", "NotBefore": not_before, "Description": "", "EventSource": "Platform"}  # fmt: skip
    return json.dumps({"DocumentIncarnation": 2, "Events": [event]}).encode()


def test_a_deadline_in_the_year_9999_is_clamped(sources: list[MetadataSource]) -> None:
    with FakeMetadata(("azure",)) as fake:
        fake.serve_raw("GET", AZURE_EVENTS, _azure_events("EVT-1", "Fri, 31 Dec 9999 23:59:59 GMT"))
        src = _start(sources, AzureSource(fake.url, interval_s=0.01, timeout_s=5.0))
        notice: Notice = wait_until(src.poll, what="the azure notice")
    assert notice.deadline == notice.received_at + MAX_NOTICE_HORIZON_S
    assert notice.deadline - time.monotonic() < threading.TIMEOUT_MAX  # every wait on it can be made


def test_text_from_the_server_cannot_forge_a_log_line(
    records: list[logging.LogRecord], sources: list[MetadataSource]
) -> None:
    forged = "EVT-1\nlightning_preempt: [preemption] committed step 999999 \x1b]0;pwned\x07"
    with FakeMetadata(("azure",)) as fake:
        fake.serve_raw("GET", AZURE_EVENTS, _azure_events(forged, "Mon, 19 Sep 2016 18:29:47 GMT"))
        src = _start(sources, AzureSource(fake.url, interval_s=0.01, timeout_s=5.0))
        wait_until(src.poll, what="the azure notice")
    (line,) = [r.getMessage() for r in records if "[notice]" in r.getMessage()]
    assert "\n" not in line and "\x1b" not in line and "\x07" not in line, line
    assert "EVT-1\\nlightning_preempt: [preemption] committed step 999999 \\x1b]0;pwned\\x07" in line


def test_untrusted_text_escapes_and_cuts() -> None:
    assert untrusted_text("plain 'text' é") == "plain 'text' é"  # honest text reads unchanged
    assert untrusted_text("a\r\nb\x1b[2J\u2028") == "a\\r\\nb\\x1b[2J\\u2028"
    assert untrusted_text("\\n") == "\\\\n"  # a literal backslash cannot pose as an escape
    assert untrusted_text("x" * 250, limit=10) == "x" * 10 + "...(+240 chars)"
    assert untrusted_text(ValueError("bad\nvalue")) == "bad\\nvalue"
