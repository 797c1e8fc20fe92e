"""Rebuilding a container with new items as the exact type it was.

The skeleton split, its merge on load and the device mapping of a loaded checkpoint walk
dicts, lists and tuples and rebuild them with new items (placeholders, tensors, moved
tensors). What a checkpoint holds must come back as the type it was: a ``torch.Size`` is
not a ``tuple`` (``.numel()``), a namedtuple keeps its fields, an ``OrderedDict`` state dict
keeps its ``_metadata`` (module versions ``load_state_dict`` reads), a ``defaultdict`` its
factory. One rule, used by every walker: :func:`rebuild`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def rebuild(original: Any, items: Any) -> Any:
    """``items`` (a dict for a mapping, a list for a sequence) as ``original``'s exact type.

    Subclasses are copied and refilled (instance attributes such as a state dict's
    ``_metadata`` and a ``defaultdict``'s factory stay); a namedtuple is made from its
    fields; any other tuple subclass (``torch.Size``) from its items. A type that cannot be
    rebuilt this way falls back to the plain container.
    """
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
