#!/usr/bin/env bash
# Sets up .venv (only python3 needed) and runs the preemption demo. README's main-job command.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[demo]' 2>&1 \
  | grep -v "^WARNING: Location" || true
exec .venv/bin/python examples/preemption_demo.py "$@"
