"""One node's tier-0 retention with the peer copy (tiers/tier0_peer.py ``prune``): with more
than two nodes a committed copy holds only some shares, and still counts."""

from __future__ import annotations

from pathlib import Path

from lightning_preempt.format.manifest import FileEntry, Manifest
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name
from lightning_preempt.tiers.tier0_peer import prune


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
    removed = prune(str(tmp_path), 2, "run-1")
    assert sorted(Path(p).name for p in removed) == [checkpoint_name(2), checkpoint_name(5)]
    assert not torn.exists() and newest.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(s) for s in (1, 4, 6, 8)]
