"""What the quick exit flushes (preemption/open_files.py): every open, writable buffered file
object in the heap, and nothing blocks the exit beyond the budget."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lightning_preempt.preemption.open_files import Flusher, flush_open_files, open_files


def test_open_writable_files_are_flushed_closed_and_read_only_ones_are_left(tmp_path: Path) -> None:
    text = open(tmp_path / "text.log", "w")  # noqa: SIM115  (left open on purpose)
    raw = open(tmp_path / "raw.bin", "wb")  # noqa: SIM115
    both = open(tmp_path / "both.bin", "w+b")  # noqa: SIM115  (io.BufferedRandom)
    (tmp_path / "read.txt").write_text("x")
    read = open(tmp_path / "read.txt")  # noqa: SIM115
    closed = open(tmp_path / "closed.txt", "w")  # noqa: SIM115
    closed.close()
    try:
        text.write("one\ntwo\n")
        raw.write(b"\x00\x01")
        both.write(b"abc")
        assert (tmp_path / "text.log").read_text() == ""  # still in the buffers
        found = open_files()
        assert {id(f) for f in (text, raw, both)} <= {id(f) for f in found}
        assert id(read) not in {id(f) for f in found} and id(closed) not in {id(f) for f in found}
        assert flush_open_files() >= 3
        assert (tmp_path / "text.log").read_text() == "one\ntwo\n"
        assert (tmp_path / "raw.bin").read_bytes() == b"\x00\x01"
        assert (tmp_path / "both.bin").read_bytes() == b"abc"
    finally:
        for f in (text, raw, both, read):
            f.close()


def test_the_exit_stops_waiting_for_a_flush_blocked_on_a_full_pipe() -> None:
    r, w = os.pipe()
    pipe = open(w, "wb", buffering=1 << 20)  # noqa: SIM115
    pipe.write(b"x" * (1 << 19))  # in the buffer; more than the pipe holds (64 KiB): flush blocks
    flusher = Flusher()
    try:
        assert flusher.flush(budget_s=0.3) is False  # returns: without the budget it never would
        assert flusher.thread.is_alive()  # still blocked in write(2)
        assert len(os.read(r, 1 << 20)) > 0  # the flush had started writing
    finally:
        os.close(r)  # the blocked write fails (EPIPE): the thread ends
        flusher.thread.join(timeout=60)
        with contextlib.suppress(BrokenPipeError):
            pipe.close()
    assert not flusher.thread.is_alive()


def test_a_flusher_flushes_only_when_asked(tmp_path: Path) -> None:
    flusher = Flusher()
    with open(tmp_path / "later.log", "w") as f:
        f.write("written after the flusher started\n")  # found by the walk made when asked
        assert flusher.thread.is_alive() and (tmp_path / "later.log").read_text() == ""
        assert flusher.flush(budget_s=60) is True
        assert (tmp_path / "later.log").read_text() == "written after the flusher started\n"
