"""torchmetrics states for exact resume: ``state_dict`` does not hold them.

torchmetrics 1.x: ``Metric._defaults`` names the state attributes, ``_update_count``
counts updates (``compute()`` warns at 0) and ``_computed`` caches ``compute()``'s result.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def metric_state_names(metric: Any) -> list[str] | None:
    """The state attributes of a torchmetrics ``Metric`` (``None``: not one we know)."""
    defaults = getattr(metric, "_defaults", None)
    return list(defaults) if isinstance(defaults, dict) else None


def metric_update_count(metric: Any) -> int:
    """How many times ``metric`` was updated since its last reset."""
    return int(getattr(metric, "_update_count", 0))


def set_metric_update_count(metric: Any, count: int) -> None:
    """Set the update count and drop the cached ``compute()`` result (it was for other states)."""
    metric._update_count = count
    metric._computed = None


def cpu_copy(value: Any) -> Any:
    """A detached CPU copy of a state value (tensor, list of tensors, anything else deep-copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, list):
        return [cpu_copy(v) for v in value]
    return copy.deepcopy(value)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


def metric_states(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """States of every torchmetrics ``Metric`` in ``module`` (not saved by ``state_dict``)."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - a Lightning dependency
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, m in module.named_modules():
        names = metric_state_names(m) if isinstance(m, Metric) else None
        if names is not None:
            out[name] = {
                "states": {attr: cpu_copy(getattr(m, attr)) for attr in names},
                "update_count": metric_update_count(m),
            }
    return out


def load_metric_states(module: torch.nn.Module, saved: dict[str, dict[str, Any]]) -> list[str]:
    """Put saved metric states back; returns the names that were not found."""
    modules = dict(module.named_modules())
    missing = []
    for name, entry in saved.items():
        m = modules.get(name)
        if m is None or metric_state_names(m) is None:
            missing.append(name)
            continue
        device = getattr(m, "device", torch.device("cpu"))
        for attr, value in entry["states"].items():
            setattr(m, attr, _to(value, device))
        set_metric_update_count(m, entry["update_count"])
    return missing
