#!/usr/bin/env bash
# The DeepSpeed venv (.venv-ds): the dev/test torch (the CPU wheel, as scripts/_venv.sh), the
# package editable with its [test] extra, and DeepSpeed pinned below. DeepSpeed is kept out
# of .venv: its tests (tests/multiproc/test_deepspeed.py) skip there and run here:
#   bash scripts/_venv_deepspeed.sh && .venv-ds/bin/python -m pytest -n 0 tests/multiproc/test_deepspeed.py
# DS_BUILD_OPS=0: no compiled ops (JIT-built on first use, none needed on CPU);
# --no-build-isolation: DeepSpeed's setup.py imports torch; in an isolated build pip would
# resolve an unpinned torch, a multi-GB CUDA build. A stamp skips the install when unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
DEEPSPEED_VERSION=0.19.8
VENV=${LP_DS_VENV:-.venv-ds}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
stamp="torch==2.13.0 deepspeed==$DEEPSPEED_VERSION [test] $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$VENV/.lp-installed" 2>/dev/null)" != "$stamp" ]; then
  source scripts/_install.sh
  install_torch "$VENV" 2.13.0
  install_rest "$VENV" -e ".[test]"
  # setuptools/wheel/packaging: the build DeepSpeed's setup.py needs without isolation.
  install_rest "$VENV" setuptools wheel packaging ninja
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    --no-build-isolation "deepspeed==$DEEPSPEED_VERSION" 2>&1 | _quiet
  echo "$stamp" > "$VENV/.lp-installed"
fi
