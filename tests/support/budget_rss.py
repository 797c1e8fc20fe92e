"""Peak host memory of saves, measured in a fresh process (tests/unit/test_host_budget.py and
benchmarks/bench_tiers.py --parts c).

``python budget_rss.py OUT_DIR --state-mib 32 --budget-mib 16 [--tensors 8] [--repeats 1]``
saves a state of ``--state-mib`` MiB in ``--tensors`` equal float32 tensors (the budget sees
only bytes) under ``host_memory_budget`` = ``--budget-mib`` MiB (0: none given, i.e. the
default), ``--repeats`` times, each time changing the live state as training would once the
save returned and waiting for the commit; then loads the last checkpoint back and prints one
JSON line:

* ``peak_growth``: the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``
  just before the save) minus its RSS then: every byte the save allocated, staging or not;
* ``stager_peak``: the stager's own accounting (buffers and chunk held at once);
* ``resident``/``streamed``: the budget's split; ``blocking_s``: the saves' blocking times;
* ``exact``: the loaded tensors and step equal the state at the save, bit for bit.

A warm-up save of one tensor of the same shape comes first (module imports, the writer
thread, the record template of that shape are not the save's staging memory).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage.store import Store

MIB = 1 << 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--state-mib", type=int, default=32)
    parser.add_argument("--budget-mib", type=int, default=16)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    numel = args.state_mib * MIB // 4 // args.tensors
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(numel, generator=gen).to(device) for i in range(args.tensors)}
    budget = args.budget_mib * MIB if args.budget_mib else None

    warm = Saver({}, host_memory_budget=budget)
    warm.save({"global_step": 0, "state_dict": {"w": torch.zeros(numel, device=device)}},
              SaveOrder(os.path.join(args.out, "warm")), wait=True)  # fmt: skip
    warm.close()
    del warm

    saver = Saver({}, host_memory_budget=budget)
    blocking_s = []
    expected = {k: v.detach().cpu().clone() for k, v in state.items()}  # the state the last save sees,
    for tensor in expected.values():  # made by the same float ops before the measurement
        for _ in range(args.repeats - 1):
            tensor.add_(1.0)
    _reset_peak()
    before = _status("VmRSS")
    for step in range(1, args.repeats + 1):
        url = os.path.join(args.out, f"ckpt{step}")
        started = time.perf_counter()
        saver.save({"global_step": step, "epoch": 1, "state_dict": state}, SaveOrder(url))
        blocking_s.append(time.perf_counter() - started)
        with torch.no_grad():
            for tensor in state.values():  # training moves on as soon as the save returns
                tensor.add_(1.0)
        saver.wait()
    peak_growth = _status("VmHWM") - before
    plan = saver.budget.last_split
    assert plan is not None
    stager_peak = saver.stager.peak_bytes
    saver.close()
    loaded = load_full_checkpoint(Store(url))
    exact = loaded["global_step"] == args.repeats and all(
        torch.equal(loaded["state_dict"][k], v) for k, v in expected.items()
    )
    print(json.dumps({
        "state": sum(v.numel() * 4 for v in expected.values()), "budget": budget, "peak_growth": peak_growth,
        "stager_peak": stager_peak, "resident": plan.resident_bytes, "streamed": plan.streamed_bytes,
        "blocking_s": blocking_s, "exact": exact,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
