"""Refresh tests/slow_costs.json, the measured cost of the tests that the slow-test sample and
the xdist order use (tests/conftest.py, docs/testing.md), from recorded runs:

    LP_FULL=1 LP_RECORD_COSTS=/tmp/costs.jsonl python -m pytest -n 3 --dist load --maxschedchunk 1
    python scripts/slow_costs.py /tmp/costs.jsonl [more.jsonl ...]

Each slow test measured gets its seconds (the last record wins; a test that was not measured
keeps its entry); a fast test of at least --threshold seconds is kept for the order only, and
one measured under it leaves the table. --show prints the slices the table makes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "tests" / "slow_costs.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="*", type=Path, help="JSON-lines files written under LP_RECORD_COSTS")
    ap.add_argument("--threshold", type=float, default=5.0, help="keep fast tests at least this long (s)")
    ap.add_argument("--show", action="store_true", help="print the slices and their cost")
    args = ap.parse_args(argv)
    table = json.loads(TABLE.read_text())
    for path in args.records:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            nodeid, seconds = rec["nodeid"], round(float(rec["seconds"]), 1)
            if rec.get("slow"):
                table["slow"][nodeid] = seconds
            elif seconds >= args.threshold:
                table["fast"][nodeid] = seconds
            else:
                table["fast"].pop(nodeid, None)
    if args.records:
        for key in ("slow", "fast"):
            table[key] = dict(sorted(table[key].items()))
        TABLE.write_text(json.dumps(table, indent=1) + "\n")
    if args.show or not args.records:
        sys.path.insert(0, str(TABLE.parent))
        slow = table["slow"]
        total = sum(slow.values())
        from conftest import MAX_PERIOD, balanced_slices  # the same split the suite uses

        period = max(1, min(MAX_PERIOD, math.ceil(total / table["budget_s"])))

        split = balanced_slices(slow, period)
        print(f"{len(slow)} slow tests, {total:.0f} worker-s; budget {table['budget_s']} s: {period} slices")
        for k in range(period):
            tests = [t for t in slow if split[t] == k]
            print(f"  slice {k}: {len(tests):3d} tests, {sum(slow[t] for t in tests):6.0f} worker-s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
