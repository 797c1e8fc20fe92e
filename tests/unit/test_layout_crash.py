"""Saving over a committed checkpoint never tears it: a crash at any storage operation of the
replacement leaves the complete old checkpoint or the complete new one at the path.

Two ways to die, each at every mutating storage operation in turn:

* local disk: :class:`CrashingStore`, a subclass of the real :class:`Store`, raises
  :class:`SimulatedCrash` at the k-th mutating call and at every later one (nothing after the
  crash moment changes anything; reads still work, as they would for the next process);
* ``crashfs://`` (tests/support/crash_fs.py): a real fsspec filesystem that dies the same way
  at the level of its own operations (open for writing, close, put, remove, move, mkdir).

After each crash a fresh process's view (a plain ``Store``) must verify (every file's size and
CRC32C against the manifest) and hold exactly the old or the new tensors; the next save must
succeed and leave the live checkpoint at the path (and at most the killed save's generation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import IO, Any, ClassVar

import pytest
import torch
from crash_fs import CrashFileSystem, SimulatedCrash

from lightning_preempt.errors import CheckpointError
from lightning_preempt.format.manifest import data_store
from lightning_preempt.format.names import is_generation
from lightning_preempt.read.load import load_all_tensors
from lightning_preempt.read.verify import verify_checkpoint
from lightning_preempt.storage.local import Owned
from lightning_preempt.storage.store import Store
from lightning_preempt.write import commit
from lightning_preempt.write.commit import SaveRequest, write_checkpoint


class CrashingStore(Store):
    """The real store that "dies" at its ``crash_at``-th mutating operation (0-based)."""

    moments: ClassVar[list[str]] = []
    crash_at: ClassVar[int | None] = None

    @classmethod
    def arm(cls, crash_at: int | None) -> None:
        cls.moments = []
        cls.crash_at = crash_at

    def _moment(self, what: str) -> None:
        CrashingStore.moments.append(f"{what} {self.url}")
        if CrashingStore.crash_at is not None and len(CrashingStore.moments) > CrashingStore.crash_at:
            raise SimulatedCrash(what)

    def makedirs(self, rel: str = "") -> None:
        self._moment(f"makedirs {rel}")
        super().makedirs(rel)

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        self._moment(f"open_write {rel}")
        with super().open_write(rel) as f:
            yield f

    def commit_bytes(self, rel: str, data: bytes, *, exclusive: bool = True, durable: bool = True) -> None:
        self._moment(f"commit_bytes {rel}")
        super().commit_bytes(rel, data, exclusive=exclusive, durable=durable)

    def rm_file(self, rel: str = "", *, durable: bool = True) -> None:
        self._moment(f"rm_file {rel}")
        super().rm_file(rel, durable=durable)

    def rm_tree(self, rel: str = "", *, owned: Owned) -> None:
        self._moment(f"rm_tree {rel}")
        super().rm_tree(rel, owned=owned)


def _tensors(step: int) -> dict[str, torch.Tensor]:
    return {f"state_dict/w{i}": torch.full((257,), float(10 * step + i)) for i in range(3)}


def _save(url: str, step: int) -> None:
    write_checkpoint(SaveRequest(url=url, tensors=_tensors(step), skeleton=b"skeleton", step=step, epoch=0))


def _complete_step(url: str) -> int:
    """The step of the checkpoint at ``url`` after checking that all of it is there."""
    store = Store(url)
    manifest = verify_checkpoint(store)  # every listed file present with its size and CRC32C
    loaded = load_all_tensors(data_store(store, manifest), manifest=manifest)
    expected = _tensors(manifest.step)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items()), "a mix of two checkpoints"
    return manifest.step


class _Local:
    """Crashes of the real Store on local disk."""

    def __init__(self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.url = str(tmp_path / "run" / "last")
        monkeypatch.setattr(commit, "Store", CrashingStore)  # write_checkpoint's root store

    def reset(self) -> None:
        CrashingStore.arm(None)
        parent = Store(self.url).parent()
        parent.rm_tree(owned=Owned(parent.path()))  # the test's own directory

    def arm(self, crash_at: int | None) -> None:
        CrashingStore.arm(crash_at)

    def moments(self) -> list[str]:
        return list(CrashingStore.moments)


class _CrashFs:
    """Crashes of a filesystem that is neither local disk nor an object store (``crashfs://``)."""

    def __init__(self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.url = "crashfs://run/last"

    def reset(self) -> None:
        CrashFileSystem.reset()

    def arm(self, crash_at: int | None) -> None:
        CrashFileSystem.arm(crash_at)

    def moments(self) -> list[str]:
        return list(CrashFileSystem.moments)


@pytest.mark.parametrize("where", [_Local, _CrashFs], ids=["local", "crashfs"])
def test_a_crash_at_every_storage_operation_leaves_the_old_or_the_new_checkpoint(
    where: type[_Local], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = where(tmp_path, monkeypatch)
    target.reset()
    _save(target.url, step=1)
    target.arm(None)  # count the moments of one replacement
    _save(target.url, step=2)
    moments = target.moments()
    assert len(moments) > 4, moments
    assert any("manifest.json" in m for m in moments), moments

    seen = []
    for crash_at in range(len(moments) + 1):  # the last one: no crash at all
        target.reset()
        _save(target.url, step=1)
        target.arm(crash_at)
        with contextlib.suppress(SimulatedCrash, CheckpointError):
            _save(target.url, step=2)
        target.arm(None)  # "restart": what a new process finds
        step = _complete_step(target.url)
        assert step in (1, 2), (crash_at, moments[crash_at : crash_at + 1])
        seen.append(step)
        # The path stays usable: the next save replaces it and clears what the crash left.
        _save(target.url, step=3)
        assert _complete_step(target.url) == 3
        store = Store(target.url)
        live = verify_checkpoint(store).extra.get("data_dir")
        entries = {e.name for e in store.entries()}
        # Besides the live checkpoint, at most the killed save's unreferenced generation
        # stays: it cannot be told from a concurrent save's, still being written (issue 20).
        left = entries - {"manifest.json", live}
        assert {"manifest.json", live} <= entries and len(left) <= 1, (crash_at, store.entries())
        assert all(is_generation(name) for name in left), (crash_at, store.entries())
    # Old until the commit, new from then on: exactly one switch, and both were seen.
    assert seen[0] == 1 and seen[-1] == 2, seen
    assert seen == sorted(seen), seen
