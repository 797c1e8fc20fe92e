"""Google Compute Engine: ``instance/preempted`` and ``instance/maintenance-event``, each
long-polled on its ``ETag``; live migration is only logged. Protocol and times: docs/notices.md.
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import urlencode

from lightning_preempt._text import untrusted_text
from lightning_preempt.preemption.notices.base import GarbageResponse, MetadataSource, Watcher, request
from lightning_preempt.preemption.sources import Notice

log = logging.getLogger(__name__)

ENV_ENDPOINT = "LP_NOTICES_GCE_ENDPOINT"
BASE = "/computeMetadata/v1/instance/"
HEADERS = {"Metadata-Flavor": "Google"}
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
    endpoint_env = (ENV_ENDPOINT, "GCE_METADATA_HOST")

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
            raise GarbageResponse(f"{BASE}preempted is {value[:100]!r}, not TRUE/FALSE")
        if value == "FALSE":
            return None
        return Notice.now("gce", f"instance/preempted is TRUE (Spot/preemptible VM stops in ~{PREEMPTED_GRACE_S:.0f}s)",
                          within_s=PREEMPTED_GRACE_S)  # fmt: skip

    def _watch_maintenance(self, stop: threading.Event) -> Notice | None:
        value = self._next_value("maintenance-event")
        if value not in _MAINTENANCE_VALUES:
            # Newer values may appear; only the documented terminating one is acted on.
            if not value or len(value) > 100:
                raise GarbageResponse(f"{BASE}maintenance-event is {value[:100]!r}")
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
        path = BASE + key + (f"?{urlencode(params)}" if params else "")
        resp = self.request("GET", path, HEADERS, timeout_s=self.wait_s + self.timeout_s if etag else self.timeout_s)
        if resp.status != 200:
            raise GarbageResponse(f"HTTP {resp.status} from {BASE}{key}")
        new_etag = resp.headers.get("etag")
        if new_etag:
            self._etags[key] = new_etag
        else:
            self._etags.pop(key, None)  # without an ETag a long-poll would not know "changed since"
        return resp.text.strip()


def probe(endpoint: str, timeout_s: float) -> bool:
    """Does a GCE metadata server answer at ``endpoint``? (for ``notices="auto"``)"""
    resp = request("GET", endpoint + BASE + "preempted", headers=HEADERS, timeout_s=timeout_s)
    return resp.status == 200 and resp.headers.get("metadata-flavor") == "Google"
