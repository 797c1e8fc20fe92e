"""Loading one per-rank state file (the skeleton): the fast road with its opcode check
(issue 32) against the road without it and the weights-only loader.

The skeleton of a checkpoint of N tensors holds N ``TensorRef`` placeholders, the exact-
resume RNG states (NumPy and torch) and Lightning's plain containers. Rows, interleaved
round by round (best of the rounds):

* ``load_state_bytes``: what resume does (the opcode check, then C pickle);
* the opcode check alone (``format/pickles/check.py``, rules ``FAST``);
* C pickle alone, unchecked: the fast road before issue 32 (unsafe: for comparison);
* ``torch.load(weights_only=True)`` with the same allow-list: the road without the fast one.

    python benchmarks/bench_state_load.py                # 24, 400, 4000 tensors, 7 rounds
    python benchmarks/bench_state_load.py --tensors 4000 --rounds 3
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _common import machine_notes, table

from lightning_preempt.format import TensorRef
from lightning_preempt.format.pickles import check, unpickle
from lightning_preempt.format.pickles.unpickle import load_state_bytes, skeleton_safe_globals


def skeleton(n: int) -> bytes:
    state = {
        "state_dict": {f"layers.{i}.weight": TensorRef(f"state_dict.layers.{i}.weight") for i in range(n)},
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "lightning_preempt": {"rng": {"numpy": np.random.RandomState(3).get_state(), "torch": torch.get_rng_state()}},
        "global_step": 100,
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="24,400,4000")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    print(machine_notes())
    rows = []
    for n in (int(t) for t in args.tensors.split(",")):
        data = skeleton(n)
        module = unpickle._MODULES[b"numpy" in data]
        pkl, has_record = check.archived_pickle(data)

        def weights_only(data: bytes = data) -> Any:
            with torch.serialization.safe_globals(skeleton_safe_globals()):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

        methods: dict[str, Callable[[], Any]] = {
            "load_state_bytes (check + C pickle)": lambda data=data: load_state_bytes(data, path="bench"),
            "opcode check alone": lambda pkl=pkl, has=has_record: check.walk(pkl, check.FAST, has),
            "C pickle unchecked (before issue 32)": lambda data=data, module=module: torch.load(
                io.BytesIO(data), map_location="cpu", weights_only=False, pickle_module=module),
            "torch.load(weights_only=True)": weights_only,
        }  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, fn in methods.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        best = {name: min(ts[1:]) for name, ts in times.items()}
        wo = best["torch.load(weights_only=True)"]
        for name, t in best.items():
            rows.append([str(n), name, f"{t * 1000:.1f}", f"{t / wo:.2f}"])
    print(table(["tensors", "method", "best (ms)", "/ weights_only"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
