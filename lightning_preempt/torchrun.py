"""``python -m lightning_preempt.torchrun ARGS`` = ``torchrun ARGS`` with the exit code a
scheduler expects (143 for a preempted node, not 1): see :mod:`lightning_preempt.elastic`."""

from __future__ import annotations

import sys

from lightning_preempt.elastic import run

if __name__ == "__main__":
    sys.exit(run())
