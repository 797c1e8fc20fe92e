"""What the CLI prints from storage is escaped, and an oversized manifest is refused fast
(issue 20, finding 9).

The CLI runs as a user runs it (``python -m lightning_preempt.cli`` in a subprocess, output
read as bytes): a directory name that holds terminal escape sequences (``ESC ] 0 ;`` sets the
window title, ``ESC [ 2 J`` clears the screen) must reach the terminal as visible text,
never as the control bytes themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_preempt._text import untrusted_text
from lightning_preempt.format import manifest as manifest_module
from lightning_preempt.format.manifest import MAX_MANIFEST_FILES, FileEntry, Manifest, parse_manifest
from lightning_preempt.format.names import MANIFEST_NAME
from lightning_preempt.storage.checksum import Crc32c

ROOT = Path(__file__).resolve().parents[2]
#: A name that would retitle the terminal, ring the bell, clear the screen and hide the rest.
CRAFTED = "ckpt\x1b]0;pwned\x07\x1b[2J\r\u202e"
ESCAPED = b"ckpt\\x1b]0;pwned\\x07\\x1b[2J\\r\\u202e"


def run_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI as a user runs it; stdout and stderr as the bytes a terminal would get."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_preempt.cli", *args],
        capture_output=True, timeout=120, cwd=ROOT, env=env, check=False,
    )  # fmt: skip


def _committed(path: Path, step: int = 3) -> Path:
    """A committed checkpoint at ``path``: one shard file and its manifest."""
    path.mkdir(parents=True)
    data = os.urandom(4096)
    (path / "__0_0.distcp").write_bytes(data)
    crc = Crc32c()
    crc.update(data)
    entry = FileEntry(size=len(data), crc32c=crc.hexdigest())
    (path / MANIFEST_NAME).write_bytes(
        Manifest(step=step, epoch=0, world_size=1, files={"__0_0.distcp": entry}).to_json()
    )
    return path


def _assert_escaped(output: bytes) -> None:
    for raw in (b"\x1b", b"\x07", b"\r", "\u202e".encode()):
        assert raw not in output
    assert ESCAPED in output


@pytest.mark.parametrize("command", [["ls"], ["ls", "--verify"], ["verify"]])
def test_a_crafted_checkpoint_name_is_printed_escaped(tmp_path: Path, command: list[str]) -> None:
    ckpt = _committed(tmp_path / CRAFTED)
    done = run_cli(*command, str(ckpt))
    assert done.returncode == 0, done.stderr
    assert b"3" in done.stdout and (b"OK step 3" in done.stdout or b"yes" in done.stdout)
    _assert_escaped(done.stdout + done.stderr)


def test_an_error_naming_a_crafted_path_is_escaped_and_keeps_its_hint(tmp_path: Path) -> None:
    (tmp_path / CRAFTED).mkdir()  # holds no checkpoint: the error names the path
    done = run_cli("verify", str(tmp_path / CRAFTED))
    assert done.returncode == 1
    _assert_escaped(done.stderr)
    assert b"\nHINT: " in done.stderr  # the HINT still starts its own line


def test_printable_escapes_only_what_does_not_print() -> None:
    assert untrusted_text("step-0000000001 ok, ünïcode 中文", None) == "step-0000000001 ok, ünïcode 中文"
    assert untrusted_text("a\x9b2Jb\x7f\u200b", None) == "a\\x9b2Jb\\x7f\\u200b"  # C1 CSI, DEL, zero-width space
    assert untrusted_text("x\ny\tz", None) == "x\\ny\\tz"
    assert untrusted_text("C:\\x1b", None) == "C:\\\\x1b"  # a literal backslash cannot pose as an escape
    assert untrusted_text("x\nHINT: y\x1b", None, keep_newlines=True) == "x\nHINT: y\\x1b"


# ---- a manifest with too many entries ---------------------------------------------------------
def _huge_manifest(n: int, key: str = '"crc32c"') -> bytes:
    """A manifest of ``n`` well-formed entries (what a crafted one looks like), built as text."""
    files = ",".join(f'"__{i}_0.distcp":{{"size":1,{key}:"00000000"}}' for i in range(n))
    head = '{"format":"lightning_preempt.checkpoint","version":1,"step":1,"epoch":0,"world_size":1,'
    return f'{head}"created_unix":0,"files":{{{files}}}}}'.encode()


def test_too_many_entries_are_refused_before_the_json_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("json.loads ran on a manifest with too many entries")

    raw = _huge_manifest(MAX_MANIFEST_FILES + 1)
    monkeypatch.setattr(manifest_module.json, "loads", no_parse)
    with pytest.raises(Exception, match=f"more than {MAX_MANIFEST_FILES} files") as info:
        parse_manifest(raw, path="memory://x")
    assert "HINT:" in str(info.value)


def test_too_many_entries_with_escaped_keys_are_refused_before_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"crc\\u0033\\u0032c"`` is the same key to JSON but not to the byte count: the
    entries are counted after the parse, before any is validated or built."""

    def no_validation(value: object) -> None:
        raise AssertionError("entries were validated one by one")

    raw = _huge_manifest(MAX_MANIFEST_FILES + 1, key='"crc\\u0033\\u0032c"')
    monkeypatch.setattr(manifest_module, "_files_field", no_validation)
    with pytest.raises(Exception, match=f"more than {MAX_MANIFEST_FILES} files"):
        parse_manifest(raw, path="memory://x")


def test_the_cli_refuses_a_manifest_with_too_many_entries(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-0000000001"
    ckpt.mkdir()
    (ckpt / MANIFEST_NAME).write_bytes(_huge_manifest(MAX_MANIFEST_FILES + 1000))
    listed = run_cli("ls", str(tmp_path))
    assert listed.returncode == 0
    assert b"  no  " in listed.stdout and f"more than {MAX_MANIFEST_FILES} files".encode() in listed.stdout
    checked = run_cli("verify", str(ckpt))
    assert checked.returncode == 2  # INVALID
    assert f"more than {MAX_MANIFEST_FILES} files".encode() in checked.stderr and b"\nHINT: " in checked.stderr
