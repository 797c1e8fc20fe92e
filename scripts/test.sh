#!/usr/bin/env bash
# Sets up .venv (only python3 needed) and runs the test suite. README's test command.
# Extra arguments go to pytest. LP_FULL=1 runs every slow matrix instead of a sample.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch is pinned for the dev/test set-up only (a CPU wheel); the package accepts a range.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]' 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/ruff check lightning_preempt tests benchmarks examples
.venv/bin/mypy lightning_preempt
exec .venv/bin/python -m pytest -q -ra "$@"
