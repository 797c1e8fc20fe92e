"""Show our INFO lines (resume, commits, the preemption timeline) by default.

As Lightning does for its own logger: when the application has configured no logging (the
root logger has no handler), the package logger gets a plain stream handler at INFO.
``propagate`` is left alone, so an application that configures logging later still receives
our records (and may remove the handler: ``logging.getLogger("lightning_preempt").handlers``).
"""

from __future__ import annotations

import logging


def configure() -> None:
    """Idempotent: add our handler only when neither the root nor our logger has one."""
    log = logging.getLogger("lightning_preempt")
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


configure()
