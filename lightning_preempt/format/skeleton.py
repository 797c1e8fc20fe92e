"""How a Lightning checkpoint dict is split between DCP and per-rank state.

* Tensors under the *sharded keys* (``state_dict`` and ``optimizer_states`` by default) go
  to torch.distributed.checkpoint as one flat ``{key: tensor}`` dict. These are the large,
  replicated (DDP) or sharded (FSDP2 ``DTensor``) tensors: DCP de-duplicates replicas so
  each rank writes ~1/N, and reshards on load.
* Everything else (loops, callbacks, hparams, RNG states, any tensor a callback keeps)
  stays in a *skeleton*: the original nesting with :class:`TensorRef` placeholders, saved
  per rank with ``torch.save``. Per-rank state stays per rank.

Flat keys are ``/``-joined paths. They only need to be unique and identical across ranks
for the same tensor; the skeleton, not the key, records where a tensor goes back.
"""

from __future__ import annotations

from collections.abc import Iterable
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
    if isinstance(value, torch.Tensor):
        key = prefix
        n = 1
        while key in out:  # e.g. {0: t} next to {"0": t}: keep both, keys stay deterministic
            key = f"{prefix}#{n}"
            n += 1
        out[key] = value
        return TensorRef(key)
    if isinstance(value, dict):
        return _same_mapping(value, {k: _extract(v, f"{prefix}/{k}", out) for k, v in value.items()})
    if isinstance(value, list):
        return [_extract(v, f"{prefix}/{i}", out) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_extract(v, f"{prefix}/{i}", out) for i, v in enumerate(value))
    return value


def merge_checkpoint(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_checkpoint`: put every referenced tensor back in place."""
    if isinstance(skeleton, TensorRef):
        return tensors[skeleton.key]
    if isinstance(skeleton, dict):
        return _same_mapping(skeleton, {k: merge_checkpoint(v, tensors) for k, v in skeleton.items()})
    if isinstance(skeleton, list):
        return [merge_checkpoint(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple) and not hasattr(skeleton, "_fields"):
        return tuple(merge_checkpoint(v, tensors) for v in skeleton)
    return skeleton


def _same_mapping(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """Rebuild ``items`` as the type of ``original`` (keeps ``OrderedDict`` state dicts)."""
    if type(original) is dict:
        return items
    try:
        return type(original)(items)  # type: ignore[no-any-return]
    except TypeError:
        return items


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

