"""What the quick exit's flush of open files costs, and what it saves (issue 55, item 8).

In a real ``Trainer`` process after a short ``fit`` of a ``Sequential`` of N linear layers:
the heap's size, the time of ``flush_open_files()`` (the ``gc.get_objects()`` walk, the
filter, the flushes), and the wall time from the script's last line to the process's end
with the interpreter's teardown (``normal``) and with ``os._exit`` (``quick``).

    python benchmarks/exit_flush.py --layers 10 1000
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time

CHILD = """
import os, sys, time
import lightning as L, torch
from torch.utils.data import DataLoader, TensorDataset
from lightning_preempt.preemption.open_files import flush_open_files
n, how = int(sys.argv[1]), sys.argv[2]
class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(n)])
    def training_step(self, b, i):
        return self.net(b[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())
t = L.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, accelerator="cpu")
t.fit(M(), DataLoader(TensorDataset(torch.randn(16, 256)), batch_size=8))
if how == "walk":
    import gc
    times = []
    for _ in range(5):
        t0 = time.perf_counter(); flushed = flush_open_files(); times.append(time.perf_counter() - t0)
    print("RESULT", len(gc.get_objects()), flushed, " ".join(f"{1e3 * x:.0f}" for x in times), flush=True)
else:
    print("END", time.time(), flush=True)
    if how == "quick":
        os._exit(0)
"""


def run(layers: int, how: str) -> tuple[str, float]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(layers), how], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert proc.stdout is not None
    line = next(x for x in proc.stdout if x.startswith(("RESULT", "END")))
    proc.wait()
    ended = time.time()
    return line, ended - float(line.split()[1]) if line.startswith("END") else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--repeats", type=int, default=2, help="exits timed per kind")
    args = p.parse_args()
    gc.disable()  # (this process only measures)
    for layers in args.layers:
        line, _ = run(layers, "walk")
        _, objects, flushed, *ms = line.split()
        print(
            f"layers={layers}: {int(objects) / 1e3:.0f}k objects, flush_open_files of {flushed} files: {' '.join(ms)} ms"
        )
        for how in ("normal", "quick"):
            took = [run(layers, how)[1] for _ in range(args.repeats)]
            print(f"layers={layers}: exit {how}: {' '.join(f'{x:.2f}' for x in took)} s (last line to process end)")


if __name__ == "__main__":
    main()
