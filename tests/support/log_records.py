"""Every record of our package logger, whatever the logging set-up (tests' fixtures)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def package_records(level: int) -> Iterator[list[logging.LogRecord]]:
    """The ``lightning_preempt`` logger's records at ``level`` and above while the block runs."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = got.append  # type: ignore[method-assign]
    logger = logging.getLogger("lightning_preempt")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield got
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
