"""``notices="auto"``: find out in the background which cloud's metadata server answers (each
answers only its own protocol at ``169.254.169.254``); :meth:`AutoSource.start` never waits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from lightning_preempt.preemption.notices import aws, azure, gce
from lightning_preempt.preemption.notices.base import MetadataSource
from lightning_preempt.preemption.sources import Notice

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0

# name -> (probe(endpoint, timeout) -> bool, source factory)
CLOUDS: dict[str, tuple[Callable[[str, float], bool], Callable[..., MetadataSource]]] = {
    "aws": (aws.probe, aws.AWSSpotSource),
    "gce": (gce.probe, gce.GCESource),
    "azure": (azure.probe, azure.AzureSource),
}


class AutoSource:
    """Probes every cloud in parallel, then runs the source of each one that answered."""

    name = "auto"

    def __init__(
        self,
        endpoints: Mapping[str, str] | None = None,
        *,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        options: Mapping[str, Mapping[str, object]] | None = None,
    ) -> None:
        self.endpoints = dict(endpoints or {})
        self.probe_timeout_s = probe_timeout_s
        self.options = {k: dict(v) for k, v in (options or {}).items()}
        self.found: list[MetadataSource] = []
        self.probed = threading.Event()  # set when every probe has answered or failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state.update(probed=None, _stop=None, _thread=None, found=[])
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.probed, self._stop = threading.Event(), threading.Event()

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        if self.probed.is_set():  # a second start (another fit): reuse what was found
            for source in self.found:
                source.start()
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_all, name="lightning_preempt-auto-probe", daemon=True)
        self._thread.start()

    def poll(self) -> Notice | None:
        for source in list(self.found):  # appended by the probe thread; iterate a copy
            notice = source.poll()
            if notice is not None:
                return notice
        return None

    def stop(self) -> None:
        self._stop.set()
        for source in list(self.found):
            source.stop()

    def _probe_all(self) -> None:
        candidates = {name: CLOUDS[name][1](self.endpoints.get(name), **self.options.get(name, {})) for name in CLOUDS}
        answered: dict[str, bool] = {}

        def one(name: str) -> None:
            try:
                answered[name] = CLOUDS[name][0](candidates[name].endpoint, self.probe_timeout_s)
            except Exception:  # REQUEST_FAILURES, or an answer that breaks the parser: not that cloud
                answered[name] = False

        probes = [threading.Thread(target=one, args=(n,), daemon=True) for n in candidates]
        for t in probes:
            t.start()
        for t in probes:
            t.join()  # each probe's whole request is bounded by probe_timeout_s
        if self._stop.is_set():
            self.probed.set()
            return
        for name in CLOUDS:  # stable order
            if answered.get(name):
                source = candidates[name]
                source.start()
                self.found.append(source)
        if self.found:
            log.info(
                "lightning_preempt: notices='auto': watching %s",
                ", ".join(f"{s.name} ({s.endpoint})" for s in self.found),
            )
        else:
            log.info(
                "lightning_preempt: notices='auto': no metadata server answered (%s); cloud notices are off",
                ", ".join(f"{n} at {c.endpoint}" for n, c in candidates.items()),
            )
        self.probed.set()
