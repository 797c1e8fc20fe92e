#!/usr/bin/env bash
# Shared by test.sh and demo.sh: create .venv (only python3 needed) and install the package
# with the extra given as $1. torch is pinned for dev/test only (a CPU wheel); the package
# itself accepts a range. A stamp skips pip when pyproject.toml and the extra are unchanged
# (the package is installed editable: code changes need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp="torch==2.13.0 [$1] $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat .venv/.lp-installed 2>/dev/null)" != "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[$1]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  echo "$stamp" > .venv/.lp-installed
fi
