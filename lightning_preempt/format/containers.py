"""Rebuilding a container with new items as the exact type it was (:func:`rebuild`): a
``torch.Size`` is not a ``tuple``, an ``OrderedDict`` keeps ``_metadata``, a ``defaultdict``
its factory, a namedtuple its fields.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def rebuild(original: Any, items: Any) -> Any:
    """``items`` (a dict or a list) as ``original``'s exact type; subclasses are copied and
    refilled, so instance attributes stay. Anything not rebuildable falls back to the plain type."""
    kind = type(original)
    if kind is dict or kind is list:
        return items
    if kind is tuple:
        return tuple(items)
    if isinstance(original, tuple):
        try:
            return kind(*items) if is_namedtuple(original) else kind(items)
        except Exception:
            return tuple(items)
    try:
        new = copy.copy(original)
        new.clear()
        new.update(items) if isinstance(original, dict) else new.extend(items)
        return new
    except Exception:
        return items


def map_leaves(obj: Any, fn: Callable[[Any, str], Any], prefix: str = "", *, descend: Callable[[Any], bool] | None = None) -> Any:
    """``obj`` with every non-container leaf replaced by ``fn(leaf, path)`` (paths ``/``-joined
    from ``prefix``), every dict, list and tuple rebuilt as its exact type (:func:`rebuild`).
    ``descend(container)`` may refuse to enter a container (it is then a leaf)."""
    if descend is not None and isinstance(obj, (dict, list, tuple)) and not descend(obj):
        return fn(obj, prefix)
    if isinstance(obj, dict):
        return rebuild(obj, {k: map_leaves(v, fn, f"{prefix}/{k}", descend=descend) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return rebuild(obj, [map_leaves(v, fn, f"{prefix}/{i}", descend=descend) for i, v in enumerate(obj)])
    return fn(obj, prefix)
