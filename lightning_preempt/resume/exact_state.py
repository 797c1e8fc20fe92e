"""The exact-resume state one rank saves, and the checks and restores any front-end makes with it.

A plain dict under :data:`STATE_KEY` in the rank's own checkpoint file (never in shared
shards)::

    {"version": 1, "rank": int, "world_size": int, "epoch": int, "global_step": int,
     "batches_in_epoch": int, "rng": capture_rng(), "loaders": ResumableLoaders.capture(),
     "metrics": metric_states(), "results": front-end specific, "accumulate": int (optional),
     "ddp_buckets": ddp_buckets.capture() (optional: None, or missing in older states)}

A change of their meaning bumps :data:`FORMAT_VERSION` (an older state is then ignored).
Here too: the RNG states (captured, restored, derived for a rank that had none) and the
torchmetrics states, which ``state_dict`` does not hold (its internals used: docs/compat.md).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

STATE_KEY = "lightning_preempt"
"""Top-level checkpoint key of the exact-resume state (stays in the per-rank skeleton)."""

FORMAT_VERSION = 1


def capture_rng() -> dict[str, Any]:
    """The RNG states of this process: Python, NumPy, torch CPU and CUDA."""
    # (numpy: the package reads tensors' bytes through it, and torchmetrics requires it)
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNG states captured by :func:`capture_rng` (missing parts are left alone)."""
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if len(cuda) != n:
            log.warning("lightning_preempt: the checkpoint has CUDA RNG states for %d devices, this process sees "
                        "%d; restoring the first %d", len(cuda), n, min(n, len(cuda)))  # fmt: skip
        for device, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(s, device)


def derive_seed(state: dict[str, Any], rank: int) -> int:
    """A seed for ``rank`` derived from another rank's saved RNG state (deterministic)."""
    digest = hashlib.sha256()
    digest.update(bytes(state["torch"].numpy().tobytes()) if "torch" in state else b"")
    digest.update(rank.to_bytes(4, "little"))
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def make_state(*, rank: int, world_size: int, epoch: int, global_step: int, batches_in_epoch: int,
               loaders: list[dict[str, Any]], metrics: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]],
               accumulate: int = 1, ddp_buckets: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """This rank's state, with the RNG states of this moment (call at the save, nothing drawn after)."""
    return {"version": FORMAT_VERSION, "rank": rank, "world_size": world_size, "epoch": epoch,
            "global_step": global_step, "batches_in_epoch": batches_in_epoch, "rng": capture_rng(),
            "loaders": loaders, "metrics": metrics, "results": results, "accumulate": accumulate,
            "ddp_buckets": ddp_buckets}  # fmt: skip


def checked(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """``state`` if this version can restore it, else ``None`` (warned: the resume is not exact)."""
    if state is not None and state.get("version") != FORMAT_VERSION:
        log.warning("lightning_preempt: exact-resume state version %r is not %d; ignoring it (the resume is not "
                    "exact)", state.get("version"), FORMAT_VERSION)  # fmt: skip
        return None
    return state


def is_mid_epoch(state: dict[str, Any] | None, epoch: int, num_batches: int | float) -> bool:
    """The loop goes on inside the saved epoch (else the save ended it and the next one starts).

    ``num_batches`` is the epoch's length (``inf`` for data without one).
    """
    return state is not None and state.get("epoch") == epoch and 0 < state["batches_in_epoch"] < num_batches


def warn_world_size(state: dict[str, Any], world_size: int) -> None:
    """Warn when the state was written by another number of ranks (the resume cannot be bit-identical)."""
    if state.get("world_size") != world_size:
        log.warning(
            "lightning_preempt: the checkpoint was written by %d ranks, this run has %d: the rest of the epoch is "
            "resharded (each sample once, for distributed samplers), but gradients average over another number of "
            "ranks and the random streams differ: not bit-identical to an uninterrupted run", state.get("world_size"),
            world_size,
        )  # fmt: skip


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


def _mapped(value: Any, tensor: Callable[[torch.Tensor], Any], other: Callable[[Any], Any]) -> Any:
    """``value`` (a tensor, a list of them, anything else) with ``tensor`` or ``other`` applied."""
    if isinstance(value, list):
        return [_mapped(v, tensor, other) for v in value]
    return tensor(value) if isinstance(value, torch.Tensor) else other(value)


def cpu_copy(value: Any) -> Any:
    """A detached CPU copy of a state value (tensor, list of tensors, anything else deep-copied)."""
    return _mapped(value, lambda t: t.detach().clone().cpu(), copy.deepcopy)


def metric_states(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """States of every torchmetrics ``Metric`` in ``module`` (not saved by ``state_dict``)."""
    from torchmetrics import Metric  # (a Lightning requirement; imported when first needed)

    out: dict[str, dict[str, Any]] = {}
    for name, m in module.named_modules():
        names = metric_state_names(m) if isinstance(m, Metric) else None
        if names is not None:
            out[name] = {"states": {attr: cpu_copy(getattr(m, attr)) for attr in names},
                         "update_count": metric_update_count(m)}  # fmt: skip
    return out


def restore_metrics(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Put the saved torchmetrics states back into ``module`` (warned for metrics it lacks)."""
    modules = dict(module.named_modules())
    missing = []
    for name, entry in state.get("metrics", {}).items():
        m = modules.get(name)
        if m is None or metric_state_names(m) is None:
            missing.append(name)
            continue
        device = getattr(m, "device", torch.device("cpu"))
        for attr, value in entry["states"].items():
            setattr(m, attr, _mapped(value, lambda t: t.to(device), lambda v: v))  # noqa: B023 (used at once)
        set_metric_update_count(m, entry["update_count"])
    if missing:
        log.warning("lightning_preempt: saved metric states not found in the model: %s", missing)


def seed_from_saved_rank(state: dict[str, Any], rank: int) -> None:
    """Seed every RNG of a rank that has no saved state from the saving rank's (deterministic; warned)."""
    seed = derive_seed(state["rng"], rank)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)  # (CPU and every CUDA device)
    log.warning("lightning_preempt: rank %d has no saved RNG state (the checkpoint had %s ranks); seeding it with %d, "
                "derived from rank %s's state", rank, state.get("world_size"), seed, state.get("rank"))  # fmt: skip


def accumulation_at(state: dict[str, Any], world_size: int, accumulate: int, global_batch: str) -> int:
    """Gradient accumulation for this run at ``world_size`` (logged when the global batch changes).

    The global batch is per-rank batch x ranks x accumulation. ``global_batch="per_rank"``
    keeps the per-rank batch and ``accumulate`` (the global batch follows the world size);
    ``"keep"`` keeps the saved global batch by scaling the saved accumulation by
    saved ranks / ranks now, where that is a whole number (else as ``"per_rank"``, said so).
    """
    saved_world, saved_acc = int(state.get("world_size") or world_size), int(state.get("accumulate") or accumulate)
    if global_batch == "keep":
        scaled, rest = divmod(saved_acc * saved_world, world_size)
        if rest == 0 and scaled >= 1:
            if saved_world != world_size:
                log.warning(
                    "lightning_preempt: %d ranks now, %d when saved: keeping the global batch (global_batch='keep'): "
                    "accumulate_grad_batches %d -> %d",
                    world_size, saved_world, saved_acc, scaled,
                )  # fmt: skip
            return scaled
        log.warning(
            "lightning_preempt: %d ranks now, %d when saved: the saved global batch (%d x %d x per-rank batch) is not "
            "a whole number of accumulations at %d ranks; keeping accumulate_grad_batches=%d, the global batch "
            "changes by %d/%d",
            world_size, saved_world, saved_world, saved_acc, world_size, accumulate,
            world_size * accumulate, saved_world * saved_acc,
        )  # fmt: skip
    elif saved_world != world_size:
        log.warning(
            "lightning_preempt: %d ranks now, %d when saved: the per-rank batch stays, so the global batch changes by "
            "%d/%d (global_batch='keep' scales accumulate_grad_batches instead where it divides)",
            world_size, saved_world, world_size * accumulate, saved_world * saved_acc,
        )  # fmt: skip
    return accumulate
