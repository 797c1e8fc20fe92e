"""How a Lightning checkpoint dict is split: tensors under the *sharded keys* (``state_dict``,
``optimizer_states``) go to DCP as one flat ``{key: tensor}`` dict (replicas de-duplicated,
resharded on load); everything else stays in a per-rank *skeleton*, the original nesting with
:class:`TensorRef` placeholders. Flat keys are ``/``-joined paths, unique and identical across
ranks for the same tensor; the skeleton, not the key, records where a tensor goes back.
Containers are rebuilt as their exact types (:func:`rebuild`): a ``torch.Size`` is not a
``tuple``, an ``OrderedDict`` keeps ``_metadata``, a ``defaultdict`` its factory.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_preempt.format import TensorRef

DEFAULT_SHARDED_KEYS: tuple[str, ...] = ("state_dict", "optimizer_states")


def split_checkpoint(
    checkpoint: dict[str, Any], sharded_keys: Iterable[str] = DEFAULT_SHARDED_KEYS
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``checkpoint`` into (flat tensors for DCP, skeleton with :class:`TensorRef`)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton: dict[str, Any] = {}
    keys = set(sharded_keys)
    for top, value in checkpoint.items():
        if top in keys:
            skeleton[top] = _extract(value, str(top), tensors)
        else:
            skeleton[top] = value
    return tensors, skeleton


def _extract(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> Any:
    """``map_leaves(value, extract, prefix)`` (tensors out, placeholders in), with plain dicts
    and lists walked inline (split while training waits); the keys and their order are the same."""

    def extract(leaf: Any, key: str) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        n, unique = 1, key
        while unique in out:  # e.g. {0: t} next to {"0": t}: keep both, keys stay deterministic
            unique = f"{key}#{n}"
            n += 1
        out[unique] = leaf
        return _ref(unique)

    def walk(node: Any, path: str) -> Any:
        kind = type(node)
        if kind is dict or kind is OrderedDict:  # (Module.state_dict(): an OrderedDict)
            walked = {}
            for k, v in node.items():  # (a state_dict: thousands of tensors, one level)
                if type(v) in _LEAF_TENSORS:  # extract() inlined: one call less per tensor
                    key = f"{path}/{k}"
                    if key in out:
                        walked[k] = extract(v, key)
                    else:
                        out[key] = v
                        walked[k] = _ref(key)
                elif type(v) in _INLINE or isinstance(v, _CONTAINERS):
                    walked[k] = walk(v, f"{path}/{k}")
                else:
                    walked[k] = v
            if kind is dict:
                return walked
            # rebuild()'s copy of an OrderedDict, without copying thousands of entries first
            ordered = OrderedDict(walked)
            ordered.__dict__.update(vars(node))  # _metadata: the module versions load_state_dict reads
            return ordered
        if kind is list:
            return [walk(v, f"{path}/{i}") if type(v) in _INLINE or isinstance(v, _CONTAINERS) else v
                    for i, v in enumerate(node)]  # fmt: skip
        if isinstance(node, (dict, list, tuple)):
            return map_leaves(node, extract, path)
        return extract(node, path)

    return walk(value, prefix)


#: walked by :func:`_extract` itself (a tensor is a leaf it extracts; a Parameter, a subclass)
_INLINE = frozenset({dict, OrderedDict, list, torch.Tensor, torch.nn.Parameter})
_CONTAINERS = (dict, list, tuple, torch.Tensor)
_LEAF_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


@functools.lru_cache(maxsize=1 << 16)
def _ref(key: str) -> TensorRef:
    # placeholders are immutable: one per key, not a new dataclass every save
    return TensorRef(key)


def merge_checkpoint(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_checkpoint`: put every referenced tensor back in place, every
    container rebuilt as the exact type it was (:func:`rebuild`)."""
    return map_leaves(skeleton, lambda leaf, _: tensors[leaf.key] if isinstance(leaf, TensorRef) else leaf)


def tensor_refs(skeleton: Any) -> list[str]:
    """Every :class:`TensorRef` key in ``skeleton`` (for verification and loading)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, TensorRef):
            found.append(node.key)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(skeleton)
    return found


# ---- rebuilding containers as their exact types -------------------------------------------
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
