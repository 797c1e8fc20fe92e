"""RNG states for exact resume: capture, restore, derive for a rank that had none."""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng() -> dict[str, Any]:
    """The RNG states of this process: Python, NumPy (if installed), torch CPU and CUDA."""
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
            log.warning(
                "lightning_preempt: the checkpoint has CUDA RNG states for %d devices, this process sees %d; "
                "restoring the first %d", len(cuda), n, min(n, len(cuda)),
            )  # fmt: skip
        for device, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(s, device)


def derive_seed(state: dict[str, Any], rank: int) -> int:
    """A seed for ``rank`` derived from another rank's saved RNG state (deterministic)."""
    digest = hashlib.sha256()
    digest.update(bytes(state["torch"].numpy().tobytes()) if "torch" in state else b"")
    digest.update(rank.to_bytes(4, "little"))
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def snapshot_iter_rng(generators: list[torch.Generator]) -> dict[str, Any]:
    """The RNG states that ``iter(loader)`` draws from: the global torch RNG and ``generators``."""
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in generators]}


def set_generator_states(generators: list[torch.Generator], states: list[Any]) -> bool:
    """Set each generator to its saved state; ``False`` (nothing set) when the counts differ."""
    if len(generators) != len(states):
        return False
    for g, state in zip(generators, states, strict=True):
        g.set_state(state)
    return True
