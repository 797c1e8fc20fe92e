"""What a local commit syncs (write/replace.py's docstring): each data file once, then the
temporary manifest, then its directory once after the manifest gets its name; the writer
claim never. Counted by recording ``os.fsync``/``os.fdatasync`` and ``os.link`` around a real
``write_checkpoint`` (one save: 8 syncs before, 5 now)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_preempt.format.names import CLAIM_NAME, MANIFEST_NAME
from lightning_preempt.read.verify import verify_checkpoint
from lightning_preempt.storage.store import Store
from lightning_preempt.write.commit import SaveRequest, write_checkpoint


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """``(call, path)`` for every sync and hard link, in order."""
    calls: list[tuple[str, str]] = []

    def wrap(name: str) -> None:
        real = getattr(os, name)

        def recorded(fd: int) -> None:
            calls.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
            real(fd)

        monkeypatch.setattr(os, name, recorded)

    for name in ("fsync", "fdatasync"):
        if hasattr(os, name):
            wrap(name)
    real_link = os.link

    def link(src: str, dst: str, *args: object, **kwargs: object) -> None:
        calls.append(("link", str(dst)))
        real_link(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", link)
    return calls


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name a synced file descriptor")
def test_a_local_commit_syncs_each_data_file_the_manifest_and_the_directory_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "step-1")
    tensors = {f"state_dict/w{i}": torch.full((64,), float(i)) for i in range(3)}
    calls = _record(monkeypatch)
    write_checkpoint(SaveRequest(url=url, tensors=tensors, skeleton=b"skeleton", step=1, epoch=0))
    monkeypatch.undo()

    manifest = verify_checkpoint(Store(url))  # committed, every file there with its CRC32C
    data_files = sorted(manifest.files)
    synced = [os.path.relpath(p, url) for call, p in calls if call == "sync"]
    assert CLAIM_NAME not in " ".join(synced)  # the claim is never synced
    assert sorted(synced[: len(data_files)]) == data_files  # each data file once, first
    assert synced[len(data_files)].startswith(f".{MANIFEST_NAME}.")  # then the temporary manifest
    assert synced[len(data_files) + 1 :] == ["."]  # then the directory, once
    # the directory sync comes after the manifest got its name
    linked = [i for i, (call, p) in enumerate(calls) if call == "link" and p.endswith(MANIFEST_NAME)]
    assert linked and calls.index(("sync", url)) > linked[0]
