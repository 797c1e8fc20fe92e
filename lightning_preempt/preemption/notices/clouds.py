"""The three clouds' notice sources (protocols, times and sources: docs/notices.md), each with
the probe ``notices="auto"`` asks whether its metadata server answers:

* AWS EC2 Spot over IMDSv2: the interruption notice (~2 min, with its deadline) and the advisory
  rebalance recommendation.
* Google Compute Engine: ``instance/preempted`` and ``instance/maintenance-event``, each
  long-polled on its ``ETag``; live migration is only logged.
* Azure Scheduled Events: ``Preempt``/``Terminate``/``Reboot``/``Redeploy`` naming this VM (an
  availability set's events reach all of it); acknowledged only with ``acknowledge=True``, in
  :meth:`AzureSource.stop`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from urllib.parse import urlencode

from lightning_preempt._text import untrusted_text
from lightning_preempt.preemption.notices.base import (
    REQUEST_FAILURES,
    GarbageResponse,
    MetadataSource,
    Watcher,
    json_object,
    parse_http_date,
    parse_iso8601,
    request,
    wall_to_monotonic,
)
from lightning_preempt.preemption.sources import Notice

log = logging.getLogger(__name__)


# ---- AWS ----------------------------------------------------------------------------------------
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
    endpoint_env = ("LP_NOTICES_AWS_ENDPOINT", "AWS_EC2_METADATA_SERVICE_ENDPOINT")

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
        body = self._get(ACTION_PATH)
        if body is not None:
            return self._interruption(body)
        if self.rebalance and not self._rebalance_seen and (body := self._get(REBALANCE_PATH)) is not None:
            self._rebalance_seen = True
            return self._recommendation(body)
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
    def _get(self, path: str) -> str | None:
        """The body at ``path``; ``None`` for a 404 (nothing announced)."""
        for attempt in (0, 1):
            resp = self.request("GET", path, {TOKEN_HEADER: self._session_token()})
            if resp.status == 401 and attempt == 0:
                self._token = None  # expired or revoked: one fresh token, then give up
                continue
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise GarbageResponse(f"HTTP {resp.status} from {path}")
            return resp.text
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


def probe_aws(endpoint: str, timeout_s: float) -> bool:
    """Does an IMDSv2 server answer at ``endpoint``? (the token PUT; for ``notices="auto"``)"""
    resp = request("PUT", endpoint + TOKEN_PATH, headers={TTL_HEADER: "60"}, timeout_s=timeout_s)
    return resp.status == 200 and 0 < len(resp.body) <= 4096


# ---- GCE ----------------------------------------------------------------------------------------
GCE_BASE = "/computeMetadata/v1/instance/"
GCE_HEADERS = {"Metadata-Flavor": "Google"}
PREEMPTED_GRACE_S = 30.0  # "about 30 seconds" between the preemption notice and the stop
MAINTENANCE_NOTICE_S = 60.0  # the value changes 60 s before the event
_MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


class GCESource(MetadataSource):
    """Long-polls the GCE metadata server for preemption and host maintenance.

    ``endpoint`` default: ``$LP_NOTICES_GCE_ENDPOINT``, ``$GCE_METADATA_HOST``, link-local.
    ``interval_s`` also follows a returned long-poll, so a server ignoring
    ``wait_for_change`` cannot make the thread spin (the ETag means nothing is missed).
    """

    name = "gce"
    endpoint_env = ("LP_NOTICES_GCE_ENDPOINT", "GCE_METADATA_HOST")

    def __init__(self, endpoint: str | None = None, *, maintenance: bool = True, wait_s: int = 60,
                 timeout_s: float = 5.0, interval_s: float = 0.5) -> None:  # fmt: skip
        super().__init__(endpoint, interval_s=interval_s, timeout_s=timeout_s)
        self.maintenance = maintenance
        self.wait_s = int(wait_s)
        self._etags: dict[str, str] = {}

    def watchers(self) -> list[Watcher]:
        self._etags = {}  # a fresh start reads the current values first
        found: list[Watcher] = [self._watch_preempted]
        if self.maintenance:
            found.append(self._watch_maintenance)
        return found

    def _watch_preempted(self, stop: threading.Event) -> Notice | None:
        value = self._next_value("preempted")
        if value not in ("TRUE", "FALSE"):
            raise GarbageResponse(f"{GCE_BASE}preempted is {value[:100]!r}, not TRUE/FALSE")
        if value == "FALSE":
            return None
        return Notice.now("gce", f"instance/preempted is TRUE (Spot/preemptible VM stops in ~{PREEMPTED_GRACE_S:.0f}s)",
                          within_s=PREEMPTED_GRACE_S)  # fmt: skip

    def _watch_maintenance(self, stop: threading.Event) -> Notice | None:
        value = self._next_value("maintenance-event")
        if value not in _MAINTENANCE_VALUES:
            # Newer values may appear; only the documented terminating one is acted on.
            if not value or len(value) > 100:
                raise GarbageResponse(f"{GCE_BASE}maintenance-event is {value[:100]!r}")
            log.info("lightning_preempt: gce maintenance-event is %r (not acted on)", untrusted_text(value))
            return None
        if value == "MIGRATE_ON_HOST_MAINTENANCE":
            log.info("lightning_preempt: gce live migration in ~%.0fs; training goes on", MAINTENANCE_NOTICE_S)
        if value != "TERMINATE_ON_HOST_MAINTENANCE":
            return None
        return Notice.now("gce", "maintenance-event TERMINATE_ON_HOST_MAINTENANCE (host maintenance in "
                          f"~{MAINTENANCE_NOTICE_S:.0f}s)", within_s=MAINTENANCE_NOTICE_S)  # fmt: skip

    def _next_value(self, key: str) -> str:
        """The current value at first, then the next *changed* value (long-poll)."""
        etag = self._etags.get(key)
        params = {"wait_for_change": "true", "last_etag": etag, "timeout_sec": str(self.wait_s)} if etag else {}
        path = GCE_BASE + key + (f"?{urlencode(params)}" if params else "")
        resp = self.request("GET", path, GCE_HEADERS, timeout_s=self.wait_s + self.timeout_s if etag else self.timeout_s)
        if resp.status != 200:
            raise GarbageResponse(f"HTTP {resp.status} from {GCE_BASE}{key}")
        new_etag = resp.headers.get("etag")
        if new_etag:
            self._etags[key] = new_etag
        else:
            self._etags.pop(key, None)  # without an ETag a long-poll would not know "changed since"
        return resp.text.strip()


def probe_gce(endpoint: str, timeout_s: float) -> bool:
    """Does a GCE metadata server answer at ``endpoint``? (for ``notices="auto"``)"""
    resp = request("GET", endpoint + GCE_BASE + "preempted", headers=GCE_HEADERS, timeout_s=timeout_s)
    return resp.status == 200 and resp.headers.get("metadata-flavor") == "Google"


# ---- Azure --------------------------------------------------------------------------------------
API_VERSION = "2020-07-01"
EVENTS_PATH = f"/metadata/scheduledevents?api-version={API_VERSION}"
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
INSTANCE_PATH = "/metadata/instance?api-version=2021-02-01"
AZURE_HEADERS = {"Metadata": "true"}
DEFAULT_EVENT_TYPES = ("Preempt", "Terminate", "Reboot", "Redeploy")
FIRST_TIMEOUT_S = 130.0  # "expect a delayed response in your first call of up to two minutes"


class AzureSource(MetadataSource):
    """Polls Azure Scheduled Events for an event that ends this VM (``endpoint`` default:
    ``$LP_NOTICES_AZURE_ENDPOINT``, else link-local); the first poll allows two minutes."""

    name = "azure"
    endpoint_env = ("LP_NOTICES_AZURE_ENDPOINT",)

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        event_types: tuple[str, ...] = DEFAULT_EVENT_TYPES,
        acknowledge: bool = False,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
    ) -> None:
        super().__init__(endpoint, interval_s=interval_s, timeout_s=timeout_s)
        self.event_types = tuple(event_types)
        self.acknowledge = acknowledge
        self.acknowledged: list[str] = []
        self._vm_name: str | None = None
        self._answered = False
        self._event_ids: list[str] = []

    def watchers(self) -> list[Watcher]:
        return [self._check]

    def stop(self) -> None:
        super().stop()
        if self.acknowledge and self._event_ids and not self.acknowledged:
            self._acknowledge(list(self._event_ids))

    # ---- one poll ----------------------------------------------------------------------
    def _check(self, stop: threading.Event) -> Notice | None:
        timeout = self.timeout_s if self._answered else max(self.timeout_s, FIRST_TIMEOUT_S)
        resp = self.request("GET", EVENTS_PATH, AZURE_HEADERS, timeout_s=timeout)
        if resp.status != 200:
            raise GarbageResponse(f"HTTP {resp.status} from {EVENTS_PATH}")
        self._answered = True
        events = json_object(resp.text, EVENTS_PATH).get("Events")
        if not isinstance(events, list):
            raise GarbageResponse(f"not a Scheduled Events document: {resp.text[:200]!r}")
        mine = [e for e in events if self._concerns_us(e)]
        if not mine:
            return None
        # The earliest one decides the deadline; remember all for the acknowledgement.
        deadlines = [(self._deadline(e), e) for e in mine]
        deadline, first = min(deadlines, key=lambda d: d[0])
        self._event_ids = [str(e["EventId"]) for e in mine if e.get("EventId")]
        return Notice.now("azure", f"scheduled event {first.get('EventType')} ({first.get('EventStatus')}, NotBefore "
                          f"{first.get('NotBefore') or 'now'}, id {first.get('EventId')})", deadline=deadline)  # fmt: skip

    def _concerns_us(self, event: object) -> bool:
        if not isinstance(event, dict):
            raise GarbageResponse(f"an event is not an object: {event!r:.200}")
        if event.get("EventType") not in self.event_types:
            return False
        resources = event.get("Resources")
        name = self._name()
        # Without a name (or a list) we cannot tell: a needless snapshot beats a lost one.
        return name is None or not isinstance(resources, list) or name in resources

    def _deadline(self, event: dict[str, object]) -> float:
        not_before = event.get("NotBefore")
        if event.get("EventStatus") == "Started" or not not_before:
            return time.monotonic()  # already under way
        if not isinstance(not_before, str):
            raise GarbageResponse(f"NotBefore is {not_before!r}")
        return wall_to_monotonic(parse_http_date(not_before))

    def _name(self) -> str | None:
        if self._vm_name is None:
            try:
                resp = self.request("GET", NAME_PATH, AZURE_HEADERS)
                name = resp.text.strip() if resp.status == 200 else ""
            except REQUEST_FAILURES as err:
                log.debug("lightning_preempt: azure: cannot read this VM's name (%s)", untrusted_text(err))
                return None
            if not name or len(name) > 256:
                return None
            self._vm_name = name
        return self._vm_name

    def _acknowledge(self, event_ids: list[str]) -> None:
        body = json.dumps({"StartRequests": [{"EventId": i} for i in event_ids]}).encode()
        try:
            resp = self.request("POST", EVENTS_PATH, {**AZURE_HEADERS, "Content-Type": "application/json"}, body=body)
        except REQUEST_FAILURES as err:
            log.warning("lightning_preempt: azure: could not acknowledge %s (%s)", untrusted_text(event_ids), untrusted_text(err))
            return
        if resp.status == 200:
            self.acknowledged = event_ids
            log.info("lightning_preempt: azure: acknowledged scheduled events %s", untrusted_text(event_ids))
        else:
            log.warning("lightning_preempt: azure: acknowledging %s got HTTP %d", untrusted_text(event_ids), resp.status)


def probe_azure(endpoint: str, timeout_s: float) -> bool:
    """Does Azure IMDS answer at ``endpoint``? (``/metadata/instance``: fast, unlike the first
    Scheduled Events call; for ``notices="auto"``)"""
    resp = request("GET", endpoint + INSTANCE_PATH, headers=AZURE_HEADERS, timeout_s=timeout_s)
    return resp.status == 200 and "compute" in json_object(resp.text, INSTANCE_PATH)
