"""Every name this package gives a file or directory, and how to recognise it.
"""

from __future__ import annotations

DCP_METADATA_NAME = ".metadata"


def checkpoint_name(step: int) -> str:
    """The directory name the callback uses for the checkpoint of ``step``."""
    return f"step-{step:010d}"

