#!/usr/bin/env bash
# Lightning's checkpointing tests, without (LP_INJECT=0) and with the plugin (README.md).
# usage: bash scripts/lightning_upstream/run.sh <folder holding tests_pytorch/ or tests_fabric/> <0|1> <report.xml> [fabric]
# "fabric": the checkpoint tests of tests_fabric (fabric_tests.txt); default: tests_pytorch/checkpointing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PY:-$repo/.venv/bin/python}
cp "$here/conftest.py" "$here/lp_adapt.py" "$1/"
if [ "${4:-}" = fabric ]; then
  # the files that save or load checkpoints, and in them the tests named for it ("load" alone
  # also names the setup_dataloaders tests)
  mapfile -t tests < <(grep -v '^#' "$here/fabric_tests.txt")
  select=(-k "save or checkpoint or (load and not dataloader)" "${tests[@]}")
else
  select=(tests_pytorch/checkpointing)
fi
cd "$1"
PYTHONPATH="$1:$repo:${PYTHONPATH:-}" OMP_NUM_THREADS=1 LP_INJECT="$2" \
  "$py" -m pytest -p no:cacheprovider -q -rA --rootdir="$1" --junitxml="$3" "${select[@]}" || true
