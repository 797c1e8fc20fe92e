"""Show our INFO lines (resume, commits, the preemption timeline) by default.

Like Lightning does for its own logger: a handler on the package logger unless the
application configured one; ``logging.getLogger("lightning_preempt")`` tunes it.
"""

from __future__ import annotations

import logging

_log = logging.getLogger("lightning_preempt")
if not _log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(logging.INFO)
    _log.propagate = False
