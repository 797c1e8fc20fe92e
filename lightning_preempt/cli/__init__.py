"""``lightning-preempt``: the operator command (``ls``, ``verify``, ``export``, ``plan``, ``report``).

Only ``export`` imports torch (an import-linter contract keeps ``ls``/``verify``/``plan`` free
of it). ``app``: parser and dispatch; ``commands/``: one module per command.
"""

from lightning_preempt.cli.app import main

__all__ = ["main"]
