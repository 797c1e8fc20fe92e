"""Which checkpoints this process knows to be intact (it committed them or verified them in
full), so retention need not read the newest back after every save. One bounded LRU per process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from lightning_preempt.format.manifest import Manifest

#: (url, manifest bytes) -> None, oldest first: a manifest that changed is another checkpoint.
_VERIFIED: OrderedDict[tuple[str, bytes], None] = OrderedDict()
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_MAX = 256


def mark_verified(url: str, manifest: Manifest) -> None:
    """Record that the checkpoint at ``url`` with ``manifest`` is known to be intact."""
    with _VERIFIED_LOCK:
        _VERIFIED[(url.rstrip("/"), manifest.to_json())] = None
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)


def is_verified(url: str, manifest: Manifest) -> bool:
    """Whether :func:`mark_verified` recorded the checkpoint at ``url`` with ``manifest``."""
    with _VERIFIED_LOCK:
        return (url.rstrip("/"), manifest.to_json()) in _VERIFIED

