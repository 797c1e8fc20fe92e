"""Cloud preemption notices: earlier warning than SIGTERM, as preemption sources. Only local
rank 0 of each node watches; per-cloud details and endpoints: docs/notices.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_preempt.preemption.notices.auto import AutoSource
from lightning_preempt.preemption.notices.aws import AWSSpotSource
from lightning_preempt.preemption.notices.azure import AzureSource
from lightning_preempt.preemption.notices.base import MetadataSource, NoopSource
from lightning_preempt.preemption.notices.gce import GCESource
from lightning_preempt.preemption.sources import PreemptionSource

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

# name -> (factory, fixed keyword arguments)
_BUILDERS: dict[str, tuple[Callable[..., MetadataSource], dict[str, Any]]] = {
    "aws": (AWSSpotSource, {}),
    "aws-interruption": (AWSSpotSource, {"rebalance": False}),  # without rebalance recommendations
    "gce": (GCESource, {}),
    "azure": (AzureSource, {}),
}
NAMES = (*_BUILDERS, "auto")
ENV_INTERVAL = "LP_NOTICES_INTERVAL_S"
_CLOUD = {"aws": "aws", "aws-interruption": "aws", "gce": "gce", "azure": "azure"}


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
        cloud: dict((options or {}).get(cloud, {})) for cloud in ("aws", "gce", "azure")
    }
    interval = os.environ.get(ENV_INTERVAL)
    if interval:  # the poll interval without code changes (e.g. from a job script)
        try:
            seconds = float(interval)
        except ValueError:
            raise ValueError(f"${ENV_INTERVAL}={interval!r} is not a number\nHINT: seconds, e.g. 1.0.") from None
        for cloud in ("aws", "gce", "azure"):
            per_cloud[cloud].setdefault("interval_s", seconds)
    sources: list[PreemptionSource] = []
    for name in names:
        if name == "auto":
            sources.append(AutoSource(endpoints, options=per_cloud))
            continue
        cloud = _CLOUD[name]
        factory, fixed = _BUILDERS[name]
        sources.append(factory(endpoints.get(cloud), **{**per_cloud[cloud], **fixed}))
    return sources
