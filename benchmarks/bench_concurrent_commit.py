"""Two plugin-level saves to one step directory at the same moment (issue 20, finding 6).

Two real writer processes, each with its own ``ShardedAsyncCheckpointIO`` and no lease (as
``ModelCheckpoint`` with the plugin, or ``lease=False``), save ~64 MiB each to the same
fresh ``step-0000000100`` directory per trial: half the trials start both at once, half
start the second writer 20 ms behind. After each trial the checkpoint at the path is
CRC32C-verified and compared bit for bit with the writer told "committed"
(tests/support/concurrent_saves.py). Prints one row per start offset:

* ``corrupt``: a writer was told "committed", yet the path does not verify or holds
  another writer's bytes (must be 0);
* ``winners``: writers told "committed";
* ``losers told``: writers that failed with "another writer committed ... first";
* ``replaced``: trials where the second write began after the first commit and replaced
  it (a plain save over a committed checkpoint: both were right to be told "committed").

    python benchmarks/bench_concurrent_commit.py             # 30 trials
    python benchmarks/bench_concurrent_commit.py --trials 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))
from concurrent_saves import run_trials


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="the second writer's start offset")
    parser.add_argument("--replace-trials", type=int, default=10, help="more trials over a committed checkpoint")
    args = parser.parse_args()
    corrupt = 0
    for replace, count in ((False, args.trials), (True, args.replace_trials)):
        if count:
            corrupt += _table(count, args.delay_ms / 1000, replace=replace)
    return 1 if corrupt else 0


def _table(count: int, delay_s: float, *, replace: bool) -> int:
    """Run ``count`` trials, print their table; returns the committed-but-corrupt count."""
    delays = [0.0 if n % 2 == 0 else delay_s for n in range(count)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lp-concurrent-") as root:
        trials = run_trials(root, delays, replace=replace)
    elapsed = time.perf_counter() - started
    what = "over a committed checkpoint (both replace it)" if replace else "into a fresh step directory"
    print(f"\n{count} trials {what}, two writer processes per trial, {elapsed:.0f} s\n")
    print("| second writer starts | trials | corrupt | winners | losers told | replaced | other failures |")
    print("|---|---|---|---|---|---|---|")
    for delay in sorted(set(delays)):
        rows = [t for t in trials if t.delay_s == delay]
        other = sum(t.told.count("failed") for t in rows) - sum(t.losers_told for t in rows)
        print(f"| +{delay * 1000:.0f} ms | {len(rows)} | {sum(t.corrupt for t in rows)} | "
              f"{sum(t.winners for t in rows)} | {sum(t.losers_told for t in rows)} | "
              f"{sum(t.replaced for t in rows)} | {other} |")  # fmt: skip
    corrupt = sum(t.corrupt for t in trials)
    print(f"\ncommitted-but-corrupt: {corrupt} of {len(trials)}")
    for t in trials:
        if t.corrupt or (t.told.count("failed") > t.losers_told):
            print(f"  +{t.delay_s * 1000:.0f} ms: told {t.told}, at the path: {t.committed_step or t.error}; "
                  f"{' / '.join(m.splitlines()[0][-200:] for m in t.messages if m)}")  # fmt: skip
    return corrupt


if __name__ == "__main__":
    raise SystemExit(main())
