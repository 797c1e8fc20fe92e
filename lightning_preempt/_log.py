"""Show our INFO lines (resume, commits, the preemption timeline) by default.

As Lightning does for its own logger: when the application has configured no logging (the
root logger has no handler), the package logger gets a plain stream handler at INFO.
``propagate`` is left alone, so an application that configures logging later still receives
our records (and may remove the handler: ``logging.getLogger("lightning_preempt").handlers``).

Also the one helper for text we did not write (a metadata server's answer, a name read from
storage) that goes into a log line: :func:`untrusted_text`.
"""

from __future__ import annotations

import logging

UNTRUSTED_LIMIT = 200  # characters of foreign text a log line carries; enough to recognise it


def untrusted_text(text: object, limit: int = UNTRUSTED_LIMIT) -> str:
    """``text`` made safe for one log line: control and non-printable characters escaped
    as ``repr`` does (``\\n``, ``\\x1b``, ``\\u2028``; a backslash doubled, so an escape
    cannot be forged either), cut to ``limit`` characters with the number cut off.

    Why: a server's or a file's text logged verbatim can start a new line that reads like
    ours (``[preemption] committed step 999999``) or drive the terminal (escape sequences).
    Printable text, quotes included, is left as it is, so an honest value reads unchanged.
    """
    raw = text if isinstance(text, str) else str(text)
    cut = raw[:limit]
    escaped = "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in cut)
    if c_left := len(raw) - len(cut):
        escaped += f"...(+{c_left} chars)"
    return escaped


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
