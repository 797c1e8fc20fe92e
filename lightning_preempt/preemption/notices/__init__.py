"""Cloud preemption notices: earlier warning than SIGTERM, as preemption sources. Only local
rank 0 of each node watches; per-cloud details and endpoints: docs/notices.md. ``"auto"``
finds out in the background which cloud's metadata server answers (each answers only its own
protocol at ``169.254.169.254``): :meth:`AutoSource.start` never waits.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_preempt.preemption.notices.base import MetadataSource, NoopSource
from lightning_preempt.preemption.notices.clouds import (
    AWSSpotSource,
    AzureSource,
    GCESource,
    probe_aws,
    probe_azure,
    probe_gce,
)
from lightning_preempt.preemption.sources import Notice, PreemptionSource

__all__ = [
    "NAMES",
    "AWSSpotSource",
    "AutoSource",
    "AzureSource",
    "GCESource",
    "NoopSource",
    "make_sources",
    "parse_names",
]

log = logging.getLogger(__name__)

# cloud -> (probe(endpoint, timeout) -> bool, source factory)
CLOUDS: dict[str, tuple[Callable[[str, float], bool], Callable[..., MetadataSource]]] = {
    "aws": (probe_aws, AWSSpotSource),
    "gce": (probe_gce, GCESource),
    "azure": (probe_azure, AzureSource),
}
# a name that is a cloud's source with fixed keyword arguments -> (cloud, those arguments)
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "aws-interruption": ("aws", {"rebalance": False}),  # without rebalance recommendations
}
NAMES = (*CLOUDS, *_VARIANTS, "auto")
ENV_INTERVAL = "LP_NOTICES_INTERVAL_S"
PROBE_TIMEOUT_S = 1.0


def parse_names(notices: str | Sequence[str] | None) -> list[str]:
    """``None``/``""``/``[]`` → ``[]``; ``"aws,gce"`` or ``["aws", "gce"]`` → validated names."""
    if notices is None:
        return []
    raw = notices.split(",") if isinstance(notices, str) else list(notices)
    names: list[str] = []
    for item in raw:
        if not isinstance(item, str):
            raise TypeError(f"notices must be names (str), got {item!r}\nHINT: e.g. notices=['aws'] or notices='auto'.")
        name = item.strip().lower()
        if not name:
            continue
        if name not in NAMES:
            raise ValueError(
                f"unknown notice source {item!r}\nHINT: use any of {', '.join(NAMES)} "
                "(a list, or 'auto' to probe which metadata server answers)."
            )
        if name not in names:
            names.append(name)
    if "auto" in names and len(names) > 1:
        raise ValueError(
            f"notices={names!r}: 'auto' already probes every cloud\nHINT: pass 'auto' alone, or name the clouds."
        )
    if "aws" in names and "aws-interruption" in names:
        raise ValueError("notices names both 'aws' and 'aws-interruption'\nHINT: keep one of them.")
    return names


def make_sources(
    notices: str | Sequence[str] | None,
    *,
    local_rank: int | None = None,
    endpoints: Mapping[str, str] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[PreemptionSource]:
    """The notice sources for ``notices`` (``None``, names as in :data:`NAMES`, comma-separated,
    or ``"auto"``), not yet started. Local ranks other than 0 get :class:`NoopSource` s.
    ``endpoints``/``options``: per cloud (``{"aws": {"interval_s": 5}}``); ``$LP_NOTICES_INTERVAL_S``
    sets every ``interval_s`` not given.
    """
    names = parse_names(notices)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if local_rank != 0:
        return [NoopSource(name) for name in names]
    endpoints = dict(endpoints or {})
    per_cloud: dict[str, dict[str, Any]] = {
        cloud: dict((options or {}).get(cloud, {})) for cloud in CLOUDS
    }
    interval = os.environ.get(ENV_INTERVAL)
    if interval:  # the poll interval without code changes (e.g. from a job script)
        try:
            seconds = float(interval)
        except ValueError:
            raise ValueError(f"${ENV_INTERVAL}={interval!r} is not a number\nHINT: seconds, e.g. 1.0.") from None
        for cloud in CLOUDS:
            per_cloud[cloud].setdefault("interval_s", seconds)
    sources: list[PreemptionSource] = []
    for name in names:
        if name == "auto":
            sources.append(AutoSource(endpoints, options=per_cloud))
            continue
        cloud, fixed = _VARIANTS.get(name, (name, {}))
        sources.append(CLOUDS[cloud][1](endpoints.get(cloud), **{**per_cloud[cloud], **fixed}))
    return sources


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
        return {**self.__dict__, "probed": None, "_stop": None, "_thread": None, "found": []}

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

        probes = [threading.Thread(target=one, args=(n,), daemon=True) for n in candidates]  # daemons: never delay an exit
        for t in probes:
            t.start()
        for t in probes:
            t.join()  # each probe's whole request is bounded by probe_timeout_s
        if self._stop.is_set():
            self.probed.set()
            return
        for name, source in candidates.items():  # stable order
            if answered[name]:
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
