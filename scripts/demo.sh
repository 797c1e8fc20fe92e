#!/usr/bin/env bash
# Sets up .venv (only python3 needed) and runs the preemption demo. README's main-job command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/_venv.sh demo
exec .venv/bin/python examples/preemption_demo.py "$@"
