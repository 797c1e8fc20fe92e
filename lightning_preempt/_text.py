"""The one way text we did not write is shown: in a log line, a CLI table, an error.

A metadata server's answer, a directory name, a manifest string come from places others
can write (docs/security.md). Shown verbatim, such text can start a new line that reads
like ours (``[preemption] committed step 999999``) or drive the terminal (``ESC ] 0 ;``
sets its title, ``ESC [ 2 J`` clears the screen, ``CR`` or a bidi override hides what is
printed).
"""

from __future__ import annotations

#: Characters of foreign text a log line carries by default: enough to recognise it.
UNTRUSTED_LIMIT = 200


def untrusted_text(text: object, limit: int | None = UNTRUSTED_LIMIT, *, keep_newlines: bool = False) -> str:
    r"""``text`` made safe to show: what :meth:`str.isprintable` refuses (controls, format
    characters, separators other than the space) escaped as ``repr`` writes it (``\n``,
    ``\x1b``, ``\u2028``), a backslash doubled so an escape cannot be forged either, and the
    text cut to ``limit`` characters (``None``: whole) with the number cut off.

    ``keep_newlines`` keeps ``\n`` (an error's ``HINT:`` line). Printable text, quotes
    included, reads unchanged.
    """
    raw = text if isinstance(text, str) else str(text)
    cut = raw if limit is None else raw[:limit]
    clean = cut.isprintable() and "\\" not in cut  # the common case, one C-level scan
    escaped = cut if clean else "".join(_show(c, keep_newlines) for c in cut)
    if c_left := len(raw) - len(cut):
        escaped += f"...(+{c_left} chars)"
    return escaped


def _show(char: str, keep_newlines: bool) -> str:
    if (char.isprintable() and char != "\\") or (keep_newlines and char == "\n"):
        return char
    return repr(char)[1:-1]
