"""Two-tier mode: save, local commit, drain and resume times per remote tier.

Remote tiers: a second local directory (the baseline), the GCS emulator and moto's S3
server, both started on 127.0.0.1 (see tests/support/servers.py). For each, with ``local_dirpath``
on local disk:

* save (blocking): ``save_checkpoint`` until it returns (staging);
* local commit: from the call until the local tier's manifest is written;
* drain: the background upload to the remote tier, manifest last;
* direct commit: the same save straight to the remote tier, no local tier (for contrast);
* resume local / resume remote: ``load_checkpoint`` (with CRC32C verification) from each tier.

Numbers are medians over rounds; ratios are to the local-disk baseline.

    python benchmarks/bench_tiers.py             # ~256 MiB, 2 rounds
    python benchmarks/bench_tiers.py --quick     # 32 MiB smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))
import servers  # noqa: E402  (sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT before gcsfs is imported)
from _common import MiB, fmt_s, lightning_style_checkpoint, machine_notes, median, table  # noqa: E402

from lightning_preempt import ShardedAsyncCheckpointIO  # noqa: E402
from lightning_preempt.storage.store import Store  # noqa: E402

COLUMNS = ("save (blocking)", "local commit", "drain", "direct commit", "resume local", "resume remote")


def one_round(
    remote_root: str, options: dict[str, Any], scratch: str, ckpt: dict[str, Any], r: int
) -> dict[str, float]:
    name = f"step-{r:010d}"
    local = os.path.join(scratch, f"local-{r}")
    io = ShardedAsyncCheckpointIO(storage_options=options, local_dirpath=local)
    assert io.tiers is not None
    io.set_tiers(remote_root)
    out: dict[str, float] = {}
    try:
        started = time.perf_counter()
        io.save_checkpoint(ckpt, f"{remote_root}/{name}")
        out["save (blocking)"] = time.perf_counter() - started
        io.wait()
        record = io.history[-1]
        out["local commit"] = record.committed_s or float("nan")
        io.wait_drained()
        drain = io.tiers.drains[-1]
        if drain.error:
            raise RuntimeError(drain.error)
        out["drain"] = drain.drained_s or float("nan")

        started = time.perf_counter()
        io.load_checkpoint(os.path.join(local, name))
        out["resume local"] = time.perf_counter() - started
    finally:
        io.teardown()

    fresh = ShardedAsyncCheckpointIO(storage_options=options)  # a new node: empty local tier
    try:
        started = time.perf_counter()
        fresh.load_checkpoint(f"{remote_root}/{name}")
        out["resume remote"] = time.perf_counter() - started
        started = time.perf_counter()
        fresh.save_checkpoint(ckpt, f"{remote_root}/direct-{r}")
        fresh.wait()
        out["direct commit"] = time.perf_counter() - started
    finally:
        fresh.teardown()
    shutil.rmtree(local, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--scratch", default=None, help="local disk for both tiers of the baseline")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.rounds = 32, 1
    ckpt = lightning_style_checkpoint(args.mib * MiB, n_tensors=16)
    scratch = tempfile.mkdtemp(prefix="lp-bench-tiers-", dir=args.scratch)
    gcs, s3 = servers.start_gcs(), servers.start_s3()
    servers.point_gcsfs_at(gcs)
    targets = [
        ("local disk", os.path.join(scratch, "remote"), {}),
        ("GCS emulator", gcs.url("bench"), dict(gcs.storage_options)),
        ("moto S3", s3.url("bench"), dict(s3.storage_options)),
    ]
    results: dict[str, dict[str, float]] = {}
    try:
        for label, root, options in targets:
            Store(root, options).stat()  # import and connect the client outside the timings
            rounds = [one_round(root, options, scratch, ckpt, r) for r in range(args.rounds)]
            results[label] = {c: median([x[c] for x in rounds]) for c in COLUMNS}
            print(f"{label}: " + ", ".join(f"{c} {fmt_s(v)}" for c, v in results[label].items()), flush=True)
    finally:
        gcs.stop()
        s3.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    base = results["local disk"]
    rows = []
    for label, res in results.items():
        cells = [label]
        for c in COLUMNS:
            ratio = res[c] / base[c] if base[c] > 0 else float("nan")
            cells.append(fmt_s(res[c]) if label == "local disk" else f"{fmt_s(res[c])} ({ratio:.1f}x)")
        rows.append(cells)
    print()
    print(f"Two-tier checkpoints, {args.mib} MiB, median of {args.rounds} round(s); (Nx) = ratio to local disk")
    print(machine_notes())
    print(table(["remote tier", *COLUMNS], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
