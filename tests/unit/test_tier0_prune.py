"""One node's tier-0 retention with the peer copy (``apply_retention(check_files=False)``): with more
than two nodes a committed copy holds only some shares, and still counts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_preempt.catalog.retention import apply_retention
from lightning_preempt.format.manifest import FileEntry, Manifest
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name


def _copy(root: Path, step: int, *, committed: bool = True, run_id: str = "run-1") -> Path:
    """Step ``step`` as node 1 of 3 holds it: its share and node 0's, not node 2's."""
    d = root / checkpoint_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"0" * 10)
    (d / "__1_0.distcp").write_bytes(b"1" * 10)
    files = {f"__{r}_0.distcp": FileEntry(10, "00000000") for r in range(3)}  # __2_0 is on node 2
    if committed:
        (d / MANIFEST_NAME).write_bytes(Manifest(step=step, epoch=0, world_size=3, files=files,
                                                 run_id=run_id).to_json())  # fmt: skip
    return d


def test_prune_keeps_the_newest_committed_copies_though_each_holds_some_shares(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _copy(tmp_path, step)
    torn = _copy(tmp_path, 5, committed=False)  # a copy killed mid-write, older than the newest
    newest = _copy(tmp_path, 8, committed=False)  # the copy being written now
    other = _copy(tmp_path, 1, run_id="another-run")
    removed = apply_retention(str(tmp_path), 2, run_id="run-1", check_files=False)
    assert sorted(Path(p).name for p in removed) == [checkpoint_name(2), checkpoint_name(5)]
    assert not torn.exists() and newest.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(s) for s in (1, 4, 6, 8)]


def _two_node_copy(root: Path, step: int, *, peer_share: bool) -> Path:
    """Step ``step`` in rank 0's node's memory with 2 nodes: the manifest and rank 0's share,
    rank 1's share only once the peer copy brought it."""
    d = root / checkpoint_name(step)
    d.mkdir(parents=True)
    files = {f"__{r}_0.distcp": FileEntry(10, "00000000") for r in range(2)}
    for r in (0, 1) if peer_share else (0,):
        (d / f"__{r}_0.distcp").write_bytes(b"x" * 10)
    (d / MANIFEST_NAME).write_bytes(Manifest(step=step, epoch=0, world_size=2, files=files, run_id="run-1").to_json())
    return d


@pytest.mark.parametrize("peer_lost", [True, False])
def test_a_failed_peer_copy_keeps_the_previous_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peer_lost: bool
) -> None:
    """Node 0 of 2, keeping 1 copy: step 4's peer copy fails (node 1 died mid-transfer), so
    step 4 here has its manifest but not rank 1's share. Retention must not count it and
    delete step 2, the newest copy whole on a node: that was the only tier-0 copy a
    replacement of node 1 could resume from (bench_node_loss.py --nodes 2). A peer copy
    that succeeds prunes as before."""
    from concurrent.futures import Future

    from lightning_preempt.engine import memory_tier

    def replicate(path: str, group: object, *, node: str) -> object:
        if peer_lost:
            raise RuntimeError("Connection closed by peer [198.18.0.2]:39090")
        (Path(path) / "__1_0.distcp").write_bytes(b"x" * 10)  # what the transfer brings
        return SimpleNamespace(bytes_sent=10, bytes_received=10, seconds=0.0)

    monkeypatch.setattr(memory_tier, "replicate", replicate)
    monkeypatch.setattr(memory_tier.pdist, "rank", lambda group=None: 0)

    class Saver:  # runs each job at once, as the job thread would after the copy committed
        def submit(self, fn: Callable[[], None]) -> Future[None]:
            fn()
            done: Future[None] = Future()
            done.set_result(None)
            return done

    old = _two_node_copy(tmp_path, 2, peer_share=True)
    new = _two_node_copy(tmp_path, 4, peer_share=False)
    tier = memory_tier.MemoryTier(str(tmp_path), 2, keep=1)
    tier.enabled, tier._peer_group, tier.nodes = True, object(), ["tier0-0", "tier0-1"]  # type: ignore[assignment]
    assert tier.replicating
    tier.after_copy(Saver(), str(new), "run-1", leader=True)  # type: ignore[arg-type]
    assert new.exists()
    assert old.exists() is peer_lost, sorted(p.name for p in tmp_path.iterdir())
    assert (new / "__1_0.distcp").exists() is not peer_lost


@pytest.mark.parametrize("peer_lost", [True, False])
def test_a_copy_counts_as_held_only_once_its_peer_copy_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peer_lost: bool
) -> None:
    """The steps tier 0 reports to the failure verdict (``MemoryTier.held``, the heartbeats'
    agreed step): on rank 0's node a copy has its manifest before the peer's share arrived. While
    its peer copy runs, and for good once it failed, it is not held (a node lost then leaves
    it without that share); the copy before it is. Once the peer copy landed it is held."""
    import threading
    from concurrent.futures import Future, ThreadPoolExecutor

    from lightning_preempt.engine import memory_tier

    landed = threading.Event()

    def replicate(path: str, group: object, *, node: str) -> object:
        assert landed.wait(30)
        if peer_lost:
            raise RuntimeError("Connection closed by peer [198.18.0.2]:39090")
        (Path(path) / "__1_0.distcp").write_bytes(b"x" * 10)
        return SimpleNamespace(bytes_sent=10, bytes_received=10, seconds=0.0)

    monkeypatch.setattr(memory_tier, "replicate", replicate)
    monkeypatch.setattr(memory_tier.pdist, "rank", lambda group=None: 0)
    pool = ThreadPoolExecutor(1)  # the saver's job thread

    class Saver:
        def submit(self, fn: Callable[[], bool]) -> Future[bool]:
            return pool.submit(fn)

    _two_node_copy(tmp_path, 2, peer_share=True)  # whole on both nodes (an earlier launch's)
    tier = memory_tier.MemoryTier(str(tmp_path), 2, keep=2)
    tier.enabled, tier._peer_group, tier.nodes = True, object(), ["tier0-0", "tier0-1"]  # type: ignore[assignment]
    path = tier.path(4, None)  # one rank: the gather is its own view
    assert path == str(tmp_path / checkpoint_name(4))
    _two_node_copy(tmp_path, 4, peer_share=False)  # committed here, the peer's share not yet
    try:
        tier.after_copy(Saver(), path, "run-1", leader=True)  # type: ignore[arg-type]
        assert tier.held() == [2]
    finally:
        landed.set()
        pool.shutdown(wait=True)
    assert tier.held() == ([2] if peer_lost else [2, 4])
