"""``lightning-preempt``: the operator command (``ls``, ``verify``, ``export``, ``plan``).

``ls``, ``verify`` and ``plan`` import neither torch nor Lightning (the manifest, sizes and
CRC32C need neither); ``export`` imports torch when it runs.
"""

from lightning_preempt.cli.commands import main

__all__ = ["main"]
