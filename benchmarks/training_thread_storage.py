"""What a periodic save asks the storage on the training thread, per store (issue 33).

A real ``Trainer.fit`` (a small model, 24 tensors, a 50 ms step standing for accelerator time,
ours saving every 5 steps: each save done before the next) to a local disk, the
GCS emulator and moto's S3 server (both on 127.0.0.1, tests/support/servers.py). Every call of
``Store`` made on the training thread inside our ``on_train_batch_end`` is counted and timed:
the round trips a save adds to a step, which a real bucket multiplies by its latency (tens of
ms each). Beside them our ``on_train_batch_end`` of a save's step as a whole, the save's
blocking time without its wait for the previous save, and that wait (``Saver.history``).
Medians over the saves after the first two.

    python benchmarks/training_thread_storage.py            # 12 saves a store
    python benchmarks/training_thread_storage.py --every 1  # back to back: the waits show
"""

from __future__ import annotations

import argparse
import collections
import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))
import servers  # noqa: E402  (sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT before gcsfs is imported)
from _common import machine_notes, median, table  # noqa: E402

STORE_CALLS = ("exists", "isdir", "makedirs", "commit_bytes", "entries", "list_dirs", "read_bytes", "rm_file")


class Spy:
    """Counts and times the ``Store`` calls of the training thread inside our hook."""

    def __init__(self) -> None:
        self.inside = False
        self.calls: collections.Counter[str] = collections.Counter()
        self.seconds = 0.0
        self.depth = 0

    def install(self) -> None:
        from lightning_preempt.storage.store import Store

        for name in STORE_CALLS:
            original = getattr(Store, name)
            setattr(Store, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def spied(store: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.inside or threading.current_thread() is not threading.main_thread():
                return original(store, *args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return original(store, *args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:  # a call inside another (exists -> info) counts once
                    self.calls[name] += 1
                    self.seconds += time.perf_counter() - t0

        return spied


def one_store(root: str, options: dict[str, Any], args: argparse.Namespace, spy: Spy) -> dict[str, Any]:
    import lightning as L
    from bench_fit_overhead import Batches, build

    from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO

    per_save: list[tuple[int, float, float]] = []  # (calls, storage s, hook s)
    callback = PreemptionCallback(root, every_n_train_steps=args.every, keep_last_n=2, storage_options=options)
    hook = callback.on_train_batch_end

    def timed(*hook_args: Any, **kwargs: Any) -> None:
        before, seconds = sum(spy.calls.values()), spy.seconds
        spy.inside = True
        t0 = time.perf_counter()
        try:
            hook(*hook_args, **kwargs)
        finally:
            spy.inside = False
            if hook_args[0].global_step % args.every == 0:  # a save's step
                per_save.append((sum(spy.calls.values()) - before, spy.seconds - seconds, time.perf_counter() - t0))

    callback.on_train_batch_end = timed  # type: ignore[method-assign]
    io = ShardedAsyncCheckpointIO(storage_options=options)
    trainer = L.Trainer(max_steps=args.saves * args.every, accelerator="cpu", devices=1, callbacks=[callback], plugins=[io],
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(build(64, 24, args.step_ms), Batches(64, 16, "cpu"))
    timed_saves = per_save[2:]
    return {
        "calls": median([c for c, _, _ in timed_saves]),
        "storage ms": 1e3 * median([s for _, s, _ in timed_saves]),
        "hook ms": 1e3 * median([h for _, _, h in timed_saves]),
        "blocking ms": 1e3 * median([r.blocking_s - r.waited_s for r in io.saver.history[2:]]),
        "waited ms": 1e3 * median([r.waited_s for r in io.saver.history[2:]]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=12, help="saves a store (default 12)")
    p.add_argument("--every", type=int, default=5, help="a save every N steps (default 5)")
    p.add_argument("--step-ms", type=float, default=50.0, help="sleep a step, for accelerator time (default 50)")
    args = p.parse_args(argv)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_preempt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", AWS_DEFAULT_REGION="us-east-1")
    spy = Spy()
    spy.install()
    scratch = tempfile.mkdtemp(prefix="lp-bench-storage-calls-")
    gcs, s3 = servers.start_gcs(), servers.start_s3()
    servers.point_gcsfs_at(gcs)
    targets = [("local disk", os.path.join(scratch, "run"), {}), ("GCS emulator", gcs.url("run"), dict(gcs.storage_options)),
               ("moto S3", s3.url("run"), dict(s3.storage_options))]  # fmt: skip
    rows = []
    try:
        for label, root, options in targets:
            got = one_store(root, options, args, spy)
            rows.append([label, f"{got['calls']:.0f}", f"{got['storage ms']:.1f}", f"{got['hook ms']:.1f}",
                         f"{got['blocking ms']:.1f}", f"{got['waited ms']:.1f}"])  # fmt: skip
            print(f"{label}: {got}", file=sys.stderr, flush=True)
    finally:
        gcs.stop()
        s3.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"### The training thread's storage calls a save ({args.saves} saves, one every {args.every} step(s) "
          f"of {args.step_ms:g} ms + CPU; medians over the saves after the first two)\n")  # fmt: skip
    print(machine_notes() + "\n")
    print(table(["store", "storage calls a save", "their ms", "our on_train_batch_end ms", "save blocking ms (without its wait)",
                 "its wait for the previous save ms"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
