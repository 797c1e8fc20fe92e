#!/usr/bin/env bash
# Sets up .venv (only python3 needed) and runs the test suite. README's test command.
# Extra arguments go to pytest. LP_FULL=1 runs every slow matrix instead of a sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/_venv.sh test
.venv/bin/ruff check lightning_preempt tests benchmarks examples
.venv/bin/mypy lightning_preempt
exec .venv/bin/python -m pytest -q -ra "$@"
