"""Which globals a pickle imports, read from its opcodes without running it or torch
(whether it would *load* is state_replay.py's and metadata_scan.py's question).
"""

from __future__ import annotations

import pickletools
import zipfile
from typing import Any


def pickled_globals(path: str) -> set[str]:
    """Every ``module.qualname`` the pickle inside the ``torch.save`` file at ``path`` imports."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        data = archive.read(names[0])
    return pickle_globals(data)


def pickle_globals(data: bytes) -> set[str]:
    """Every ``module.qualname`` a pickle imports (``GLOBAL`` and ``STACK_GLOBAL``)."""
    found: set[str] = set()
    memo: dict[Any, Any] = {}
    recent: list[Any] = []  # what each op pushed, as far as strings go
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "GLOBAL":
            module, qualname = str(arg).split(" ", 1)
            found.add(f"{module}.{qualname}")
            recent.append(None)
        elif name == "STACK_GLOBAL":
            if len(recent) >= 2 and isinstance(recent[-2], str) and isinstance(recent[-1], str):
                found.add(f"{recent[-2]}.{recent[-1]}")
            else:
                found.add("<unknown>.<unknown>")
            recent.append(None)
        elif "UNICODE" in name or "STRING" in name:
            recent.append(arg)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = recent[-1] if recent else None
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            recent.append(memo.get(arg))
        else:
            recent.append(None)
    return found
