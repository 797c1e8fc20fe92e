"""Which checkpoints this process knows to be intact: it committed them (the CRC32C came
from the bytes it wrote) or read and verified them in full. Retention needs one verified
checkpoint before it deletes anything; this saves reading the newest one back after
every save.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from lightning_preempt.format.manifest import Manifest

# ---- which checkpoints are known to verify ------------------------------------------------
# A checkpoint this process committed (CRC32C computed from the bytes it wrote) or read in
# full and verified. Retention needs one verified checkpoint before it deletes anything;
# remembering them saves reading the newest checkpoint back after every save.
_VERIFIED: OrderedDict[tuple[str, bytes], None] = OrderedDict()
_VERIFIED_LOCK = threading.Lock()
_VERIFIED_MAX = 256


def mark_verified(url: str, manifest: Manifest) -> None:
    """Record that the checkpoint at ``url`` with ``manifest`` is known to be intact."""
    with _VERIFIED_LOCK:
        _VERIFIED[(url.rstrip("/"), manifest.to_json())] = None
        while len(_VERIFIED) > _VERIFIED_MAX:
            _VERIFIED.popitem(last=False)


def _is_verified(url: str, manifest: Manifest) -> bool:
    with _VERIFIED_LOCK:
        return (url.rstrip("/"), manifest.to_json()) in _VERIFIED

