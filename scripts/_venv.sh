#!/usr/bin/env bash
# Shared by test.sh and demo.sh: create .venv (only python3 needed) and install the package
# with the extra given as $1. torch is pinned for dev/test only (a CPU wheel); the package
# itself accepts a range. A stamp skips the install when pyproject.toml and the extra are
# unchanged (the package is installed editable: code changes need no reinstall).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp="torch==2.13.0 [$1] compiled $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat .venv/.lp-installed 2>/dev/null)" != "$stamp" ]; then
  source scripts/_install.sh
  install_torch .venv 2.13.0
  install_rest .venv -e ".[$1]"
  echo "$stamp" > .venv/.lp-installed
fi
