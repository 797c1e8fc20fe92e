"""DDP's gradient buckets at a resume: the layout a run reduced in, saved with a checkpoint
and given back to the resumed process's DDP for its first backward (docs/exact-resume.md,
"DDP's gradient buckets", has the cause and the measurement).

DDP reduces a process's first backward in its initial buckets, then rebuilds them once in the
order the gradients became ready; a resumed process would reduce its first step in the initial
layout, and at three ranks or more gloo's ring allreduce then adds in another order: other last
bits. :func:`capture` reads the rebuilt layout at a save; :func:`build` constructs DDP with it
as the initial layout (the Trainer: the checkpoint is read before the strategy wraps the model);
:func:`rebuild` gives it to a DDP already built that has not reduced yet (Fabric: ``fabric.setup``
wraps the model before the checkpoint is read). Both use DDP internals (its logging data and
``torch.distributed._compute_bucket_assignment_by_size``); where they are missing or the
layout does not fit the model, nothing is captured or given (logged) and DDP goes its own way.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

__all__ = ["Layout", "build", "capture", "clean", "rebuild"]

T = TypeVar("T")
Layout = dict[str, list[Any]]
"""``{"buckets": [[param index, ...], ...], "bytes": [bucket bytes, ...]}``, in reduction order."""

# The layout each DDP built by :func:`build` started with: what a save from its first steps
# records (DDP's logging data shows the rebuild only from the next sampled iteration on).
_given: weakref.WeakKeyDictionary[DistributedDataParallel, Layout] = weakref.WeakKeyDictionary()


def _not_given(why: str) -> None:
    log.warning("lightning_preempt: the saved DDP bucket layout %s; its first step reduces in DDP's initial buckets "
                "(at 3+ ranks the resume is then not bit-identical)", why)  # fmt: skip


def _given_to(model: DistributedDataParallel, layout: Layout) -> None:
    _given[model] = layout
    log.info("lightning_preempt: DDP reduces in the saved layout of its %d gradient bucket(s)", len(layout["buckets"]))


def capture(model: object) -> Layout | None:
    """The bucket layout ``model`` (a DDP module) reduces in from now on; ``None`` for
    another module, one rank, or a DDP that has not rebuilt its buckets (yet, or ever:
    ``find_unused_parameters``). Cheap: reads DDP's logging data, no collective."""
    if not isinstance(model, DistributedDataParallel) or model.process_group.size() < 2:
        return None
    try:
        data = model._get_ddp_logging_data()
    except (AttributeError, RuntimeError):  # another torch: no exact layout, no failure
        return None
    if not data.get("has_rebuilt_buckets") or "rebuilt_per_bucket_param_indices" not in data:
        return _given.get(model)
    return clean({"buckets": [b.split() for b in str(data["rebuilt_per_bucket_param_indices"]).split(",")],
                  "bytes": str(data.get("rebuilt_bucket_sizes", "")).split(",")})  # fmt: skip


def clean(layout: Any) -> Layout | None:
    """``layout`` as plain ints (what came from a checkpoint), or ``None`` when it is not one."""
    try:
        buckets = [[int(i) for i in b] for b in layout["buckets"]]
        sizes = [int(n) for n in layout["bytes"]]
    except (KeyError, TypeError, ValueError):
        return None
    if not buckets or len(sizes) != len(buckets) or not all(buckets):
        return None
    return {"buckets": buckets, "bytes": sizes}


def _fits(layout: Layout, tensors: list[torch.Tensor]) -> bool:
    """Every parameter in one bucket, and each bucket's size as saved (the same model)."""
    flat = sorted(i for b in layout["buckets"] for i in b)
    if flat != list(range(len(tensors))):
        return False
    return all(
        sum(tensors[i].numel() * tensors[i].element_size() for i in b) == n
        for b, n in zip(layout["buckets"], layout["bytes"], strict=True)
    )


@contextlib.contextmanager
def _initial_buckets(layout: Layout, applied: list[bool]) -> Iterator[None]:
    original = dist._compute_bucket_assignment_by_size

    def assign(tensors: list[torch.Tensor], limits: list[int], *args: Any, **kwargs: Any) -> Any:
        if applied or args[1:] or kwargs.get("tensor_indices") or not _fits(layout, tensors):
            return original(tensors, limits, *args, **kwargs)  # a rebuild-style call, or another model
        applied.append(True)
        # DDP reverses the list it gets (from parameter order to the order gradients come).
        buckets = list(reversed(layout["buckets"]))
        return buckets, [limits[min(i, len(limits) - 1)] for i in range(len(buckets))]

    dist._compute_bucket_assignment_by_size = assign  # type: ignore[assignment]
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = original


def build(make: Callable[[], T], layout: Layout | None) -> T:
    """``make()`` (which constructs a DDP module), whose first backward reduces in ``layout``.

    ``layout`` must be the same on every rank (DDP does not compare initial layouts across
    ranks): the caller agrees on it first. ``None``, or a layout that does not fit the model,
    leaves DDP's own initial buckets.
    """
    if layout is None or not hasattr(dist, "_compute_bucket_assignment_by_size"):
        return make()
    applied: list[bool] = []
    with _initial_buckets(layout, applied):
        model = make()
    if applied and isinstance(model, DistributedDataParallel):
        _given_to(model, layout)
    else:
        _not_given("does not fit this model")
    return model


def rebuild(model: object, layout: Layout | None) -> bool:
    """Give ``layout`` to ``model``, a DDP module built but not yet run backward: its reducer
    is made again with the saved layout as its initial buckets (what DDP's own
    ``__setstate__`` does to make one). Returns whether the layout was applied.

    Collective-free, but ``layout`` must be the same on every rank (the caller agrees on it).
    Nothing changes for ``None``, another module, one rank, a DDP that has already reduced
    (its reducer holds buckets and state of its own), one with a communication hook (a new
    reducer would drop it), or a layout that does not fit the model.
    """
    if layout is None or not isinstance(model, DistributedDataParallel) or model.process_group.size() < 2:
        return False
    # A DDP that reduced already has rebuilt (or is about to rebuild) from its own order; a comm
    # hook registered on the reducer would be lost with it; without the internals, DDP's own way.
    needed = ("_ddp_init_helper", "_build_params_for_reducer", "_build_debug_param_to_name_mapping")
    if (
        getattr(model, "_comm_hooks", None)
        or not all(hasattr(model, name) for name in needed)
        or not hasattr(dist, "_compute_bucket_assignment_by_size")
        or _has_reduced(model)
    ):
        _not_given("cannot be given to this DDP")
        return False
    parameters, expect_sparse = model._build_params_for_reducer()
    names = model._build_debug_param_to_name_mapping(parameters)
    applied: list[bool] = []
    with _initial_buckets(layout, applied):
        model._ddp_init_helper(parameters, expect_sparse, names, model.static_graph)
    if model.static_graph:  # as DDP's __setstate__ after its own _ddp_init_helper
        model.reducer._set_static_graph()
        if model.logger is not None:
            model.logger._set_static_graph()
    if not applied:
        _not_given("does not fit this model")
        return False
    _given_to(model, layout)
    return True


def _has_reduced(model: DistributedDataParallel) -> bool:
    """Whether ``model`` ran a backward that reduced (DDP's logging data counts them)."""
    try:
        data = model._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return True  # unknown: do not replace a reducer that may hold state
    return bool(data.get("has_rebuilt_buckets")) or int(data.get("iteration", 0) or 0) > 0
