"""Azure Scheduled Events: ``Preempt``/``Terminate``/``Reboot``/``Redeploy`` naming this VM
(an availability set's events reach all of it). Acknowledged only with ``acknowledge=True``,
in :meth:`AzureSource.stop`. Format, times, sources: docs/notices.md.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from lightning_preempt._text import untrusted_text
from lightning_preempt.preemption.notices.base import (
    REQUEST_FAILURES,
    GarbageResponse,
    MetadataSource,
    Watcher,
    json_object,
    parse_http_date,
    request,
    wall_to_monotonic,
)
from lightning_preempt.preemption.sources import Notice

log = logging.getLogger(__name__)

ENV_ENDPOINT = "LP_NOTICES_AZURE_ENDPOINT"
API_VERSION = "2020-07-01"
EVENTS_PATH = f"/metadata/scheduledevents?api-version={API_VERSION}"
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
INSTANCE_PATH = "/metadata/instance?api-version=2021-02-01"
HEADERS = {"Metadata": "true"}
DEFAULT_EVENT_TYPES = ("Preempt", "Terminate", "Reboot", "Redeploy")
FIRST_TIMEOUT_S = 130.0  # "expect a delayed response in your first call of up to two minutes"


class AzureSource(MetadataSource):
    """Polls Azure Scheduled Events for an event that ends this VM (``endpoint`` default:
    ``$LP_NOTICES_AZURE_ENDPOINT``, else link-local); the first poll allows two minutes."""

    name = "azure"
    endpoint_env = (ENV_ENDPOINT,)

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
        resp = self.request("GET", EVENTS_PATH, HEADERS, timeout_s=timeout)
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
                resp = self.request("GET", NAME_PATH, HEADERS)
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
            resp = self.request("POST", EVENTS_PATH, {**HEADERS, "Content-Type": "application/json"}, body=body)
        except REQUEST_FAILURES as err:
            log.warning("lightning_preempt: azure: could not acknowledge %s (%s)", untrusted_text(event_ids), untrusted_text(err))
            return
        if resp.status == 200:
            self.acknowledged = event_ids
            log.info("lightning_preempt: azure: acknowledged scheduled events %s", untrusted_text(event_ids))
        else:
            log.warning("lightning_preempt: azure: acknowledging %s got HTTP %d", untrusted_text(event_ids), resp.status)


def probe(endpoint: str, timeout_s: float) -> bool:
    """Does Azure IMDS answer at ``endpoint``? (``/metadata/instance``: fast, unlike the first
    Scheduled Events call; for ``notices="auto"``)"""
    resp = request("GET", endpoint + INSTANCE_PATH, headers=HEADERS, timeout_s=timeout_s)
    return resp.status == 200 and "compute" in json_object(resp.text, INSTANCE_PATH)
