#!/usr/bin/env bash
# Lightning's checkpointing tests, without (LP_INJECT=0) and with the plugin (README.md).
# usage: bash scripts/lightning_upstream/run.sh <folder holding tests_pytorch/> <0|1> <report.xml>
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cp "$here/conftest.py" "$here/lp_adapt.py" "$1/"
cd "$1"
PYTHONPATH="$1:$repo:${PYTHONPATH:-}" OMP_NUM_THREADS=1 LP_INJECT="$2" \
  "$repo/.venv/bin/python" -m pytest -p no:cacheprovider -q -rA --rootdir="$1" --junitxml="$3" tests_pytorch/checkpointing || true
