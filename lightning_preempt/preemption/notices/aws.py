"""AWS EC2 Spot over IMDSv2: the interruption notice (~2 min, with its deadline) and the
advisory rebalance recommendation. Protocol and sources: docs/notices.md.
"""

from __future__ import annotations

import threading
import time

from lightning_preempt.preemption.notices.base import (
    GarbageResponse,
    MetadataSource,
    Watcher,
    json_object,
    parse_iso8601,
    request,
    wall_to_monotonic,
)
from lightning_preempt.preemption.sources import Notice

ENV_ENDPOINT = "LP_NOTICES_AWS_ENDPOINT"
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"


class AWSSpotSource(MetadataSource):
    """Watches IMDSv2 for a Spot interruption (``rebalance``: also the advisory recommendation).
    ``endpoint`` default: ``$LP_NOTICES_AWS_ENDPOINT``, ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``,
    link-local."""

    name = "aws"
    endpoint_env = (ENV_ENDPOINT, "AWS_EC2_METADATA_SERVICE_ENDPOINT")

    def __init__(self, endpoint: str | None = None, *, rebalance: bool = True, interval_s: float = 2.0,
                 timeout_s: float = 2.0, token_ttl_s: int = 21600) -> None:  # fmt: skip
        super().__init__(endpoint, interval_s=interval_s, timeout_s=timeout_s)
        self.rebalance = rebalance
        self.token_ttl_s = int(token_ttl_s)
        self._token: str | None = None
        self._token_expires = 0.0
        self._rebalance_seen = False

    def watchers(self) -> list[Watcher]:
        return [self._check]

    # ---- one check ---------------------------------------------------------------------
    def _check(self, stop: threading.Event) -> Notice | None:
        status, body = self._get(ACTION_PATH)
        if status == 200:
            return self._interruption(body)
        if status != 404:
            raise GarbageResponse(f"HTTP {status} from {ACTION_PATH}")
        if self.rebalance and not self._rebalance_seen:
            status, body = self._get(REBALANCE_PATH)
            if status == 200:
                self._rebalance_seen = True
                return self._recommendation(body)
            if status != 404:
                raise GarbageResponse(f"HTTP {status} from {REBALANCE_PATH}")
        return None

    def _interruption(self, body: str) -> Notice:
        doc = json_object(body, ACTION_PATH)
        action, when = doc.get("action"), doc.get("time")
        if not isinstance(action, str) or not isinstance(when, str):
            raise GarbageResponse(f"{ACTION_PATH} lacks 'action'/'time': {body[:200]!r}")
        return Notice.now("aws", f"spot instance-action {action!r} at {when}", deadline=wall_to_monotonic(parse_iso8601(when)))

    def _recommendation(self, body: str) -> Notice:
        when = json_object(body, REBALANCE_PATH).get("noticeTime")
        if not isinstance(when, str):
            raise GarbageResponse(f"{REBALANCE_PATH} lacks 'noticeTime': {body[:200]!r}")
        parse_iso8601(when)  # validate only: it says when AWS noticed, not when the node goes
        return Notice.now("aws", f"rebalance recommendation (elevated interruption risk, noticed {when}; no deadline)")

    # ---- IMDSv2 ------------------------------------------------------------------------
    def _get(self, path: str) -> tuple[int, str]:
        for attempt in (0, 1):
            resp = self.request("GET", path, {TOKEN_HEADER: self._session_token()})
            if resp.status == 401 and attempt == 0:
                self._token = None  # expired or revoked: one fresh token, then give up
                continue
            return resp.status, resp.text
        raise GarbageResponse(f"HTTP 401 from {path} with a fresh IMDSv2 token")

    def _session_token(self) -> str:
        now = time.monotonic()
        if self._token is None or now >= self._token_expires:
            resp = self.request("PUT", TOKEN_PATH, {TTL_HEADER: str(self.token_ttl_s)})
            token = resp.text.strip()
            # It goes back in a header: printable ASCII only (CR/LF or non-ASCII would make
            # http.client raise ValueError/UnicodeEncodeError on every later request).
            if resp.status != 200 or not token or len(token) > 4096 or not (token.isascii() and token.isprintable()):
                raise GarbageResponse(f"HTTP {resp.status} from PUT {TOKEN_PATH} (no IMDSv2 token)")
            self._token = token
            self._token_expires = now + max(self.token_ttl_s - 60, self.token_ttl_s / 2)  # renew early
        return self._token


def probe(endpoint: str, timeout_s: float) -> bool:
    """Does an IMDSv2 server answer at ``endpoint``? (the token PUT; for ``notices="auto"``)"""
    resp = request("PUT", endpoint + TOKEN_PATH, headers={TTL_HEADER: "60"}, timeout_s=timeout_s)
    return resp.status == 200 and 0 < len(resp.body) <= 4096
