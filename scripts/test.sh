#!/usr/bin/env bash
# Sets up .venv (only python3 needed) and runs the test suite. README's test command.
# Extra arguments go to pytest (after ours: `-n 0` runs in one process). LP_FULL=1 runs every
# slow matrix instead of a sample; LP_SLICE=k runs slice k of the cost-balanced sample
# (tests/conftest.py, tests/slow_costs.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/_venv.sh test
.venv/bin/ruff check lightning_preempt tests benchmarks examples
# mypy (~30 s) and the layer contracts run beside the tests, whose processes mostly wait;
# their verdict comes after the tests' and fails the command the same way.
lint_log=$(mktemp)
(.venv/bin/mypy lightning_preempt && .venv/bin/lint-imports) >"$lint_log" 2>&1 &
lint=$!
# 3 xdist workers on 2 cores: the tests wait on training processes, sockets and signals for
# much of their time (3 workers: 6m42s, 2: 8m09s, 4: 6m14s, on one loaded 2-core machine back
# to back). `--dist load --maxschedchunk 1`: a worker gets the next test when it is free, and
# the workers collect the tests longest first (tests/slow_costs.json, tests/conftest.py), so no
# 60 s test starts last (worksteal split the list in contiguous thirds: sorted longest first,
# one worker would hold all the long tests).
status=0
.venv/bin/python -m pytest -q -ra -n 3 --dist load --maxschedchunk 1 "$@" || status=$?
if ! wait "$lint"; then
  cat "$lint_log"
  echo "mypy or lint-imports failed (above)" >&2
  [ "$status" -ne 0 ] || status=1
fi
grep -E "^Success|kept" "$lint_log" || true
exit "$status"
