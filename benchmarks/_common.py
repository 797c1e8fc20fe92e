"""Helpers shared by the benchmarks: state dicts, medians, markdown tables, verdicts."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

MiB = 1 << 20
GiB = 1 << 30


def lightning_style_checkpoint(total_bytes: int, n_tensors: int, step: int = 100) -> dict[str, Any]:
    """A Lightning-shaped checkpoint dict holding ~``total_bytes`` of float32 tensors.

    Half the tensors are "weights" under ``state_dict``, half are SGD momentum buffers
    under ``optimizer_states`` (int keys, as torch optimizers produce them).
    """
    n_weights = max(1, n_tensors // 2)
    n_moments = max(1, n_tensors - n_weights)
    numel = total_bytes // (4 * (n_weights + n_moments))
    cols = 1024
    rows = max(1, numel // cols)
    gen = torch.Generator().manual_seed(0)
    state_dict = {f"layers.{i}.weight": torch.randn(rows, cols, generator=gen) for i in range(n_weights)}
    opt_state = {i: {"momentum_buffer": torch.randn(rows, cols, generator=gen)} for i in range(n_moments)}
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": state_dict,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "callbacks": {},
        "optimizer_states": [
            {"state": opt_state, "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": list(range(n_moments))}]}
        ],
        "lr_schedulers": [],
    }


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list structure, in a stable order."""
    out: list[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(tensors_of(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(tensors_of(v))
    return out


def nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(obj))


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def fmt_s(x: float | None) -> str:
    if x is None or x != x:  # NaN
        return "—"
    return f"{x:.3f}"


def fmt_range(xs: Sequence[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}" if xs else "—"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def verdict(name: str, value: float, target: float, higher_is_better: bool) -> tuple[list[str], str]:
    """A ratio row for the table and a one-line verdict."""
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    status = "met" if ok else "MISSED"
    return [name, f"{value:.2f}", f"{sign} {target:g}", status], f"- {name}: {value:.2f} (target {sign} {target:g}): {status}"


def machine_notes() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {platform.node()}; {os.cpu_count()} CPUs; "
        f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads); python {platform.python_version()}; "
        f"loadavg {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}"
    )


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
