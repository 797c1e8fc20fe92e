"""``python -m lightning_preempt.cli``: the same as the ``lightning-preempt`` command."""

import sys

from lightning_preempt.cli import main

if __name__ == "__main__":
    sys.exit(main())
