#!/usr/bin/env bash
# The minimum-versions job: a second venv (.venv-min) holding the oldest torch, Lightning,
# fsspec, gcsfs, s3fs and crc32c that pyproject.toml accepts (its `>=` floors, pinned by
# scripts/min_versions.py), then a sample of the suite on it. Arguments go to pytest
# (none: the wider sample below; --ci: CI's small one). LP_MIN_SETUP_ONLY=1 only builds the venv.
#
# PyPI's torch wheels for Linux x86_64 are CUDA builds: the first set-up downloads about
# 3 GB (torch + nvidia-* wheels; ~1-2 min at 50 MB/s) and the venv is kept afterwards
# (rebuilt only when the floors change).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LP_MIN_VENV:-.venv-min}
PINS=$(python3 scripts/min_versions.py)
if [ "${1:-}" = "--ci" ] && [ "${LP_FULL:-0}" != 1 ]; then
  # CI samples the matrix: every floor but torch's. The torch floor exists on PyPI only as a
  # ~3 GB CUDA build (minutes to fetch and install); LP_FULL=1 runs it. CI keeps the dev/test
  # torch (a CPU wheel) with the oldest Lightning, fsspec, gcsfs, s3fs and crc32c.
  PINS=$(echo "$PINS" | sed -E 's/(^| )torch==[^ ]+/\1torch==2.13.0/')
  VENV=${LP_MIN_VENV:-.venv-min-ci}
fi
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.floors" 2>/dev/null)" != "$PINS" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # The pins go in as constraints, so pip fails loudly when a floor cannot be installed
  # together with the rest; --no-cache-dir would re-download 3 GB each time: keep the cache.
  echo "$PINS" | tr ' ' '\n' > "$VENV/constraints.txt"
  source scripts/_install.sh
  install_torch "$VENV" "$(echo "$PINS" | tr ' ' '\n' | sed -n 's/^torch==//p')"
  install_rest "$VENV" -c "$VENV/constraints.txt" $PINS -e ".[test]"
  echo "$PINS" > "$VENV/.floors"
fi
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import version
names = ["torch", "lightning", "fsspec", "gcsfs", "s3fs", "crc32c", "torchdata", "torchmetrics", "botocore"]
print("minimum versions:", ", ".join(f"{n} {version(n)}" for n in names))
EOF
[ "${LP_MIN_SETUP_ONLY:-0}" = 1 ] && exit 0
if [ "${1:-}" = "--ci" ]; then
  # CI's sample (about a minute once the venv exists): the private names, a real Trainer
  # that saves and resumes through the plugin, the S3 create-only PUT, one exact-resume job.
  shift
  set -- tests/unit/test_exact_compat.py tests/e2e/test_exact_enable_checkpointing.py \
    "tests/e2e/test_exact_loaders.py::test_exact_resume_loader_fast" "$@"
elif [ $# -eq 0 ]; then
  # The wider sample (several minutes on 2 cores): the plugin and the callback in real
  # Trainers, DCP shards on 2 ranks, the GCS/S3 emulators, exact resume.
  set -- tests/unit/test_exact_compat.py tests/e2e/test_exact_enable_checkpointing.py tests/unit/test_checkpoint_io.py \
    tests/e2e/test_trainer.py tests/multiproc/test_sharded.py tests/objectstore/test_objectstore.py tests/e2e/test_exact_loaders.py \
    "tests/e2e/test_exact_resume.py::test_sigterm_three_times_single_process"
fi
exec "$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider "$@"
