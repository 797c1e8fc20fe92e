#!/usr/bin/env bash
# The GPU check (issues 25, 33), one command on a machine with one CUDA GPU, under 12 minutes
# (each step has its own timeout: 4 + 7 + 5 minutes at the very most):
#   1. the tests marked `gpu` (tests/gpu/: pinned staging, staging on a CUDA stream, the
#      overlapped copy, CUDA RNG in exact resume, the host budget with pinned memory);
#   2. benchmarks/bench_device.py --device cuda: the table of the pinned D2H floor, our blocking
#      time and staging GB/s, DCP async_save with DefaultStager, step time with a save;
#   3. benchmarks/bench_fit_overhead.py --device cuda (issue 33): the whole-fit overhead table
#      of docs/benchmarks.md on the GPU, with ours twice, overlap_staging off and on: the row
#      pairs that decide AUTO_ON_CUDA in lightning_preempt/staging/overlap.py (docs/staging.md).
# The report is printed and written to $OUT/gpu_check.md (or ./gpu_check.md).
#
#   scripts/gpu_check.sh            # on the GPU machine
#   scripts/gpu_check.sh --dry-run  # anywhere: CPU, tiny sizes; proves the script and code paths
#
# Python: $LP_PYTHON, else .venv/bin/python, else python3 -- the first that imports torch,
# lightning, fsspec, crc32c and pytest. The package runs from this checkout (PYTHONPATH), so
# no install is needed. A GPU machine without internet must already have such a Python with
# a CUDA build of torch (a CUDA torch is GBs: too big to carry along); with internet,
# `bash scripts/_venv.sh test` then `.venv/bin/pip install torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cu128` makes one. LP_GPU_SIZE_MIB sets the state size of the
# bench (default 4096; 13312 measures the issue's 13 GB shard, ~60 GB of pinned host memory).
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

needs='import torch, lightning, fsspec, crc32c, pytest'
py=""
for candidate in "${LP_PYTHON:-}" .venv/bin/python python3; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$needs" 2>/dev/null; then
    py="$candidate"
    break
  fi
done
if [ -z "$py" ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "gpu_check: no Python with torch, lightning, fsspec, crc32c and pytest; creating .venv (needs internet)" >&2
    bash scripts/_venv.sh test
    py=.venv/bin/python
  else
    echo "gpu_check: .venv/bin/python lacks one of torch, lightning, fsspec, crc32c, pytest" >&2
    echo "HINT: set LP_PYTHON to a Python that has them, or rerun bash scripts/_venv.sh test (needs internet)." >&2
    exit 2
  fi
fi

if [ "$dry" = 0 ]; then
  if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$py" -c 'import torch; print(f"gpu_check: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no GPU")' >&2
    echo "HINT: on a GPU machine, install a CUDA build of torch into $py's environment, e.g." >&2
    echo "  $py -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" >&2
    echo "or set LP_PYTHON to a Python that has one (check: python -c 'import torch; print(torch.cuda.is_available())');" >&2
    echo "to try the script without a GPU: scripts/gpu_check.sh --dry-run" >&2
    exit 2
  fi
  device=cuda size="${LP_GPU_SIZE_MIB:-4096}" tensors=24 repeats=3 fit_args="--ranks 1 --rounds 2"
else
  device=cpu size=16 tensors=8 repeats=1 fit_args="--dry-run"
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
report="${OUT:-.}/gpu_check.md"
mkdir -p "$(dirname "$report")"
started=$(date +%s)
{
  echo "## scripts/gpu_check.sh$([ "$dry" = 1 ] && echo ' --dry-run') ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo
  "$py" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, " + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"))'
  echo
} | tee "$report"

set +e
# LP_FULL=1: no slow-test sampling; the gpu tests run (or, without CUDA, skip) all.
LP_FULL=1 timeout 240 "$py" -m pytest -q -n 0 -p no:cacheprovider -m gpu -ra tests/gpu 2>&1 | tail -n 25 | tee -a "$report"
tests_rc=${PIPESTATUS[0]}
echo | tee -a "$report"
# stderr goes to a file, and its tail into the report when a step fails: a failure says why.
errs="$(mktemp -d)"
trap 'rm -rf "$errs"' EXIT
timeout 420 "$py" benchmarks/bench_device.py --device "$device" --size-mib "$size" --tensors "$tensors" \
  --repeats "$repeats" 2>"$errs/bench" | tee -a "$report"
bench_rc=${PIPESTATUS[0]}
[ "$bench_rc" = 0 ] || { echo "bench_device.py failed (rc=$bench_rc); its stderr ends:"; tail -n 30 "$errs/bench"; } | tee -a "$report"
echo | tee -a "$report"
# shellcheck disable=SC2086  # fit_args is a list of flags
timeout 300 "$py" benchmarks/bench_fit_overhead.py --device "$device" $fit_args 2>"$errs/fit" | tee -a "$report"
fit_rc=${PIPESTATUS[0]}
[ "$fit_rc" = 0 ] || { echo "bench_fit_overhead.py failed (rc=$fit_rc); its stderr ends:"; tail -n 30 "$errs/fit"; } | tee -a "$report"
set -e

echo | tee -a "$report"
echo "gpu tests: rc=$tests_rc; bench: rc=$bench_rc; fit overhead: rc=$fit_rc; took $(( $(date +%s) - started ))s; report: $report" | tee -a "$report"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$fit_rc" = 0 ]
