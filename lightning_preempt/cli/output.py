"""What the commands print: tables, errors, dates and the progress bar (stderr)."""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

from lightning_preempt._text import untrusted_text
from lightning_preempt.cli.options import PROG
from lightning_preempt.cli.plan import format_bytes


class ProgressBar:
    """A minimal stderr progress bar (about 10 redraws a second, then a final line)."""

    def __init__(self, total: int, label: str) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = sys.stderr
        self.done = 0
        self._started = time.perf_counter()
        self._drawn = 0.0
        self._draw()

    def update(self, nbytes: int) -> None:
        """Count ``nbytes`` more (the ``progress`` callback of verify_checkpoint)."""
        self.done += nbytes
        if time.perf_counter() - self._drawn >= 0.1:
            self._draw()

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._draw()
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self) -> None:
        self._drawn = time.perf_counter()
        frac = min(self.done / self.total, 1.0)
        width = 30
        filled = int(frac * width)
        rate = self.done / max(self._drawn - self._started, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {frac:6.1%} "
            f"{format_bytes(self.done)} / {format_bytes(self.total)} ({format_bytes(rate)}/s)"
        )
        self.stream.flush()


def print_error(label: str, err: BaseException) -> None:
    """``lightning-preempt: LABEL: message`` (ending with its HINT) on stderr, escaped: it may
    quote names and texts read from storage."""
    print(untrusted_text(f"{PROG}: {label}: {err}", None, keep_newlines=True), file=sys.stderr)


def print_note(text: str) -> None:
    """One line on stderr, escaped (:func:`~lightning_preempt._text.untrusted_text`)."""
    print(untrusted_text(text, None), file=sys.stderr)


def print_table(rows: list[list[str]], right_aligned: set[int]) -> None:
    """``rows`` (the first is the header) in columns two spaces apart; every cell escaped
    (:func:`~lightning_preempt._text.untrusted_text`): names and problems come from storage."""
    rows = [[untrusted_text(c, None) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.rjust(w) if i in right_aligned else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())


def utc(unix: float) -> str:
    """``2026-11-30T04:04:36Z``."""
    return datetime.datetime.fromtimestamp(unix, tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def dash(value: Any) -> str:
    """``value`` as text, ``-`` for ``None``."""
    return "-" if value is None else str(value)
