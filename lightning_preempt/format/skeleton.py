"""How a Lightning checkpoint dict is split: tensors under the *sharded keys* (``state_dict``,
``optimizer_states``) go to DCP as one flat ``{key: tensor}`` dict (replicas de-duplicated,
resharded on load); everything else stays in a per-rank *skeleton*, the original nesting with
placeholders. Flat keys are ``/``-joined paths, unique and identical across ranks for the same
tensor; the skeleton, not the key, records where a tensor goes back. Containers are rebuilt as
their exact types (:func:`rebuild`): a ``torch.Size`` is not a ``tuple``, an ``OrderedDict``
keeps ``_metadata``, a ``defaultdict`` its factory.

Since format 3 the skeleton lists the keys once under :data:`REFS_KEY`, in the order a
depth-first walk meets the placeholders, and every placeholder is the one :data:`NEXT_REF`, or
for a dict of tensors only (a module's ``state_dict``) one :class:`TensorDict`: 4000 tensors
pickle as one object and one string, not a Python call each while training waits
(docs/design.md, "The skeleton's placeholders"). Older skeletons hold one ``TensorRef(key)``
per tensor; both load.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from lightning_preempt.format import TensorDict, TensorRef

DEFAULT_SHARDED_KEYS: tuple[str, ...] = ("state_dict", "optimizer_states")
#: The placeholder of every tensor in a format-3 skeleton: "the next key of :data:`REFS_KEY`".
NEXT_REF = TensorRef("")
#: The skeleton's top-level key of the flat keys in walk order (one string, :data:`_SEP`-joined,
#: or a list when a key holds the separator); never a key of a Lightning checkpoint.
REFS_KEY = "lightning_preempt.refs"
_SEP = "\n"
#: Dicts of at least this many tensors, and nothing else (a module's ``state_dict``), become one
#: :class:`TensorDict`, remembered by :class:`Splitter` across saves; smaller ones are walked.
_REMEMBERED_LEN = 32


def split_checkpoint(
    checkpoint: dict[str, Any], sharded_keys: Iterable[str] = DEFAULT_SHARDED_KEYS
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``checkpoint`` into (flat tensors for DCP, skeleton with placeholders)."""
    return Splitter().split(checkpoint, sharded_keys)


class Splitter:
    """:func:`split_checkpoint` that remembers each large all-tensor dict it met (a module's
    ``state_dict``: its keys, flat keys and :class:`TensorDict`), so the next save of the same
    keys costs a few C-level passes instead of a Python step per tensor. One per saver."""

    def __init__(self) -> None:
        self._known: dict[str, _Known] = {}

    def split(
        self, checkpoint: dict[str, Any], sharded_keys: Iterable[str] = DEFAULT_SHARDED_KEYS
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Split ``checkpoint`` into (flat tensors for DCP, skeleton with placeholders)."""
        if REFS_KEY in checkpoint:
            raise ValueError(
                f"the checkpoint has a top-level key {REFS_KEY!r}, which the sharded format reserves.\n"
                "HINT: rename that key (e.g. in on_save_checkpoint)."
            )
        tensors: dict[str, torch.Tensor] = {}
        skeleton: dict[str, Any] = {}
        keys = set(sharded_keys)
        for top, value in checkpoint.items():
            skeleton[top] = self._extract(value, str(top), tensors) if top in keys else value
        skeleton[REFS_KEY] = _joined(list(tensors))
        return tensors, skeleton

    def _extract(self, value: Any, prefix: str, out: dict[str, torch.Tensor]) -> Any:
        """``map_leaves(value, extract, prefix)`` (tensors out, :data:`NEXT_REF` in), with
        plain dicts and lists walked inline (split while training waits); the keys and their
        order are the same."""
        known = self._known

        def extract(leaf: Any, key: str) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            n, unique = 1, key
            while unique in out:  # e.g. {0: t} next to {"0": t}: keep both, keys stay deterministic
                unique = f"{key}#{n}"
                n += 1
            out[unique] = leaf
            return NEXT_REF

        def walk(node: Any, path: str) -> Any:
            kind = type(node)
            if kind is dict or kind is OrderedDict:  # (Module.state_dict(): an OrderedDict)
                seen = known.get(path)
                if seen is not None and seen.matches(node, out):
                    out.update(zip(seen.flat, node.values()))
                    return seen.marker_for(node)
                walked = {}
                for k, v in node.items():  # (a state_dict: thousands of tensors, one level)
                    if type(v) in _LEAF_TENSORS:  # extract() inlined: one call less per tensor
                        key = f"{path}/{k}"
                        if key in out:
                            walked[k] = extract(v, key)
                        else:
                            out[key] = v
                            walked[k] = NEXT_REF
                    elif type(v) in _INLINE or isinstance(v, _CONTAINERS):
                        walked[k] = walk(v, f"{path}/{k}")
                    else:
                        walked[k] = v
                if len(node) >= _REMEMBERED_LEN and (entry := _Known.of(node, path, out)) is not None:
                    known[path] = entry
                    return entry.marker
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


@dataclasses.dataclass
class _Known:
    """A dict :class:`Splitter` met: tensors only, under str keys, none renamed; its
    placeholder is one :class:`TensorDict`."""

    keys: tuple[str, ...]
    flat: tuple[str, ...]
    flat_set: frozenset[str]
    marker: TensorDict

    @staticmethod
    def of(node: dict[Any, Any], path: str, out: dict[str, Any]) -> _Known | None:
        keys = tuple(node)
        if not (all(type(k) is str for k in keys) and _all_tensors(node)):
            return None
        flat = tuple(f"{path}/{k}" for k in keys)
        if not all(out.get(key) is v for key, v in zip(flat, node.values())):  # one renamed (#1)
            return None
        try:
            marker = TensorDict(path, len(keys), type(node) is OrderedDict, _attrs(node))
        except ValueError:  # attributes a TensorDict does not carry: placeholders one by one
            return None
        return _Known(keys, flat, frozenset(flat), marker)

    def matches(self, node: dict[Any, Any], out: dict[str, Any]) -> bool:
        """``node`` has these keys, in this order, all tensors, none taken yet in ``out``."""
        return (
            len(node) == len(self.keys)
            and (type(node) is OrderedDict) == self.marker.ordered
            and tuple(node) == self.keys
            and _all_tensors(node)
            and (not out or out.keys().isdisjoint(self.flat_set))  # (a state_dict comes first: out is empty)
        )

    def marker_for(self, node: dict[Any, Any]) -> TensorDict | OrderedDict[str, Any]:
        """The placeholder of ``node`` (:meth:`matches`): the marker, with ``node``'s attributes."""
        attrs = _attrs(node)
        if attrs != self.marker.attrs:  # other module versions
            try:
                self.marker = dataclasses.replace(self.marker, attrs=attrs)
            except ValueError:  # attributes a TensorDict does not carry: placeholders one by one
                ordered = OrderedDict.fromkeys(self.keys, NEXT_REF)
                ordered.__dict__.update(attrs)
                return ordered
        return self.marker


def _all_tensors(node: dict[Any, Any]) -> bool:
    return set(map(type, node.values())) <= _LEAF_TENSORS  # (one C-level pass)


def _attrs(node: dict[Any, Any]) -> dict[str, Any]:
    return dict(vars(node)) if type(node) is OrderedDict else {}


#: walked by :meth:`Splitter._extract` itself (a tensor is a leaf it extracts; a Parameter, a subclass)
_INLINE = frozenset({dict, OrderedDict, list, torch.Tensor, torch.nn.Parameter})
_CONTAINERS = (dict, list, tuple, torch.Tensor)
_LEAF_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def _joined(keys: list[str]) -> str | list[str]:
    joined = _SEP.join(keys)
    return joined if keys and joined.count(_SEP) == len(keys) - 1 else keys


def skeleton_refs(skeleton: Any) -> list[str] | None:
    """The flat keys of a format-3 skeleton in walk order; ``None`` for an older skeleton."""
    refs = skeleton.get(REFS_KEY) if isinstance(skeleton, dict) else None
    if refs is None:
        return None
    if isinstance(refs, str):
        return refs.split(_SEP)
    if isinstance(refs, list) and all(isinstance(k, str) for k in refs):
        return refs
    raise ValueError(f"the state's {REFS_KEY!r} is a {type(refs).__name__}, not the list of tensor keys")


def merge_checkpoint(skeleton: Any, tensors: Mapping[str, Any]) -> Any:
    """Inverse of :func:`split_checkpoint`: put every referenced tensor back in place, every
    container rebuilt as the exact type it was (:func:`rebuild`).

    Raises:
        ValueError: the placeholders and the listed keys do not pair up (a damaged state).
    """
    refs = skeleton_refs(skeleton)
    if refs is None:  # before format 3: each placeholder names its key
        return map_leaves(skeleton, lambda leaf, _: tensors[leaf.key] if isinstance(leaf, TensorRef) else _old(leaf))
    order: Iterator[str] = iter(refs)

    def fill(leaf: Any, _: str) -> Any:
        if type(leaf) is TensorDict:
            return _expand(leaf, order, tensors)
        if not isinstance(leaf, TensorRef):
            return leaf
        return tensors[next(order)] if leaf.key == NEXT_REF.key else tensors[leaf.key]

    try:
        merged = map_leaves({k: v for k, v in skeleton.items() if k != REFS_KEY}, fill)
    except StopIteration:
        raise ValueError(f"the state has more tensor placeholders than keys ({len(refs)})") from None
    if next(order, None) is not None:
        raise ValueError(f"the state lists {len(refs)} tensor keys but has fewer placeholders")
    return merged


def _expand(leaf: TensorDict, order: Iterator[str], tensors: Mapping[str, Any]) -> dict[str, Any]:
    keys = list(itertools.islice(order, leaf.count))
    if len(keys) < leaf.count:
        raise ValueError(f"the state has more tensor placeholders than keys (at {leaf.prefix!r})")
    start = leaf.prefix + "/"
    if not all(key.startswith(start) for key in keys):
        raise ValueError(f"the state's keys for {leaf.prefix!r} do not start with it")
    items = {key[len(start) :]: tensors[key] for key in keys}
    if len(items) < leaf.count:
        raise ValueError(f"the state lists a key of {leaf.prefix!r} twice")
    if not leaf.ordered:
        return items
    ordered = OrderedDict(items)
    ordered.__dict__.update(leaf.attrs)
    return ordered


def _old(leaf: Any) -> Any:
    if type(leaf) is TensorDict:
        raise ValueError("the state has a TensorDict placeholder but no list of keys")
    return leaf


def tensor_refs(skeleton: Any) -> list[str]:
    """Every tensor key ``skeleton`` refers to (for verification and loading)."""
    refs = skeleton_refs(skeleton)
    if refs is not None:
        return refs
    found: list[str] = []  # before format 3: each placeholder names its key, in walk order
    map_leaves(skeleton, lambda leaf, _: found.append(leaf.key) if isinstance(leaf, TensorRef) else None)
    return found


# ---- rebuilding containers as their exact types -------------------------------------------
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
            return kind(*items) if hasattr(kind, "_fields") else kind(items)  # a namedtuple
        except Exception:
            return tuple(items)
    try:
        new = copy.copy(original)
        new.clear()
        new.update(items) if isinstance(original, dict) else new.extend(items)
        return new
    except Exception:
        return items


def map_leaves(obj: Any, fn: Callable[[Any, str], Any], prefix: str = "") -> Any:
    """``obj`` with every non-container leaf replaced by ``fn(leaf, path)`` (paths ``/``-joined
    from ``prefix``), every dict, list and tuple rebuilt as its exact type (:func:`rebuild`)."""
    if isinstance(obj, dict):
        return rebuild(obj, {k: map_leaves(v, fn, f"{prefix}/{k}") for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return rebuild(obj, [map_leaves(v, fn, f"{prefix}/{i}") for i, v in enumerate(obj)])
    return fn(obj, prefix)
