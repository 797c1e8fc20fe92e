"""A replayed save writes its small template records joined into a few large writes
(write/records.py: ``gather``), from views of the staged buffers that the stager makes the
layout drop before it allocates anew; a tensor resized in place is a new structure key
(format/structure.py); ``.metadata``'s ``storage_data`` is kept while
the result lists are the same (write/dcp_metadata.py). The bytes stay those of a save made item
by item, the commit stays last, and a failed replay is raised once with nothing committed."""

from __future__ import annotations

import gc
import os
import pickle
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import assert_loads_both_ways

from lightning_preempt.errors import CheckpointWriteError
from lightning_preempt.format.names import DCP_METADATA_NAME, MANIFEST_NAME
from lightning_preempt.format.structure import Structures
from lightning_preempt.read.verify import verify_checkpoint
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage import local
from lightning_preempt.storage.store import Store
from lightning_preempt.write import dcp_writer, records
from lightning_preempt.write.commit import SaveRequest, write_checkpoint
from lightning_preempt.write.planning import PlanCache


def _state(step: int, *, w0: tuple[int, ...] = (3, 4)) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    tensors = {f"w{i}": torch.randn(w0 if i == 0 else (3, 4), generator=gen) for i in range(60)}
    tensors["mid"] = torch.randn(16, 16, generator=gen)  # over the (lowered) gather size: written apart
    tensors["big"] = torch.randn(64, 64, generator=gen)  # over the (lowered) template size: torch.save
    tensors["half"] = torch.randn(5, 2, generator=gen).to(torch.bfloat16)  # no numpy dtype
    tensors["count"] = torch.tensor(step, dtype=torch.int64)  # 0-dim
    return {"state_dict": tensors, "optimizer_states": [], "global_step": step, "epoch": 0}


def _shards(url: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in url.iterdir() if p.name.endswith(".distcp")}


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "TEMPLATE_MAX_BYTES", 4096)
    monkeypatch.setattr(records, "GATHER_MAX_DATA", 512)
    monkeypatch.setattr(records, "GATHER_BYTES", 8192)  # several joined writes a file


def test_gathered_writes_are_the_bytes_of_an_item_by_item_save(tmp_path: Path, small_limits: None) -> None:
    saver = Saver({})
    try:
        for step in (1, 2, 3):  # 1 records the layout; 2 gathers it; 3 replays the gathered one
            saver.save(_state(step), SaveOrder(str(tmp_path / f"s{step}")), wait=True)
        layout = saver.plan_cache.records
        assert layout is not None and layout.segments is not None
        kinds = {type(s).__name__ if not isinstance(s, tuple) else ("joined" if s[0] else "apart")
                 for file in layout.segments for s in file}  # fmt: skip
        assert kinds == {"int", "joined", "apart"}  # torch.save records, joined runs, large records alone
        assert sum(isinstance(s, tuple) and s[0] for file in layout.segments for s in file) > 1
    finally:
        saver.close()
    fresh = Saver({})  # the same state, written item by item
    try:
        fresh.save(_state(3), SaveOrder(str(tmp_path / "fresh")), wait=True)
    finally:
        fresh.close()
    assert _shards(tmp_path / "s3") == _shards(tmp_path / "fresh")
    reference = pickle.loads((tmp_path / "fresh" / DCP_METADATA_NAME).read_bytes())
    for step in (1, 2, 3):
        url = tmp_path / f"s{step}"
        assert_loads_both_ways(str(url), _state(step))  # this save's values, CRC32C checked
        metadata = pickle.loads((url / DCP_METADATA_NAME).read_bytes())
        assert metadata.storage_data == reference.storage_data
        assert metadata.storage_meta.checkpoint_id == str(url)


def test_the_layout_lets_go_of_a_buffer_before_the_stager_allocates_its_successor(
    tmp_path: Path, small_limits: None
) -> None:
    saver = Saver({})
    try:
        for step in (1, 2):
            saver.save(_state(step), SaveOrder(str(tmp_path / f"s{step}")), wait=True)
        layout = saver.plan_cache.records
        assert layout is not None and layout.segments is not None  # views of the buffers
        old = weakref.ref(saver.stager._buffers["state_dict/w0"])
        saver.prepare_staging(_state(3, w0=(5, 4)), background=False)  # w0's buffer is replaced
        gc.collect()
        assert layout.segments is None
        assert old() is None  # nothing kept the old buffer alive beside the new one
        saver.save(_state(4, w0=(5, 4)), SaveOrder(str(tmp_path / "s4")), wait=True)
        saver.save(_state(5, w0=(5, 4)), SaveOrder(str(tmp_path / "s5")), wait=True)
    finally:
        saver.close()
    assert_loads_both_ways(str(tmp_path / "s4"), _state(4, w0=(5, 4)))
    assert_loads_both_ways(str(tmp_path / "s5"), _state(5, w0=(5, 4)))


def test_a_tensor_resized_in_place_changes_the_structure_key_and_is_planned_afresh(tmp_path: Path) -> None:
    structures, cache = Structures(), PlanCache()
    tensors = {f"state_dict/w{i}": torch.full((8,), float(i)) for i in range(20)}

    def save(step: int) -> str:
        url = str(tmp_path / f"s{step}")
        request = SaveRequest(url=url, tensors=tensors, skeleton=b"", step=step, epoch=0,
                              structure=structures.key(tensors))  # fmt: skip
        write_checkpoint(request, plan_cache=cache)
        return url

    save(1)
    save(2)  # the same structure: the local plan reused
    assert cache.hits["local"] == 1
    tensors["state_dict/w3"].resize_(4)  # the same object, in place: fewer elements
    save(3)
    assert cache.hits["local"] == 1  # a new key: planned afresh
    tensors["state_dict/w3"].fill_(7.0)
    url = save(4)
    assert cache.hits["local"] == 2
    import torch.distributed.checkpoint as dcp

    target = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(target, checkpoint_id=url, no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in tensors.items())
    assert verify_checkpoint(Store(url)).step == 4


def test_a_failed_gathered_write_commits_nothing_is_raised_once_and_the_next_save_plans_afresh(
    tmp_path: Path, small_limits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver = Saver({})
    real_write = dcp_writer._HashingStream.write
    failing = [False]

    def write(self: Any, b: Any) -> int:
        if failing[0] and memoryview(b).nbytes >= 4096:  # a joined write of the replay
            raise OSError(28, "No space left on device")
        return int(real_write(self, b))

    monkeypatch.setattr(dcp_writer._HashingStream, "write", write)
    try:
        for step in (1, 2):
            saver.save(_state(step), SaveOrder(str(tmp_path / f"s{step}")), wait=True)
        failing[0] = True
        with pytest.raises(CheckpointWriteError, match="No space left"):
            saver.save(_state(3), SaveOrder(str(tmp_path / "s3")), wait=True)
        failing[0] = False
        assert not (tmp_path / "s3" / MANIFEST_NAME).exists()
        assert saver.plan_cache.records is None  # every cache cleared: the next save plans afresh
        saver.save(_state(4), SaveOrder(str(tmp_path / "s4")), wait=True)  # the failure is not raised again
        saver.save(_state(5), SaveOrder(str(tmp_path / "s5")), wait=True)
    finally:
        saver.close()
    assert_loads_both_ways(str(tmp_path / "s4"), _state(4))
    assert_loads_both_ways(str(tmp_path / "s5"), _state(5))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name a synced file descriptor")
def test_a_gathered_save_syncs_every_data_file_before_its_manifest_is_written(
    tmp_path: Path, small_limits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    saver = Saver({})
    events: list[str] = []
    real_sync, real_atomic = local.sync_data, local.write_atomic

    def sync_data(fd: int) -> None:
        events.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_sync(fd)

    def write_atomic(path: str, data: Any, **kwargs: Any) -> None:
        events.append(f"commit {os.path.basename(path)}")
        real_atomic(path, data, **kwargs)

    try:
        for step in (1, 2):
            saver.save(_state(step), SaveOrder(str(tmp_path / f"s{step}")), wait=True)
        monkeypatch.setattr(local, "sync_data", sync_data)
        monkeypatch.setattr(local, "write_atomic", write_atomic)
        saver.save(_state(3), SaveOrder(str(tmp_path / "s3")), wait=True)  # a gathered replay
    finally:
        saver.close()
    manifest = verify_checkpoint(Store(str(tmp_path / "s3")))
    events = [e for e in events if not e.startswith("commit ") or e == f"commit {MANIFEST_NAME}"]  # (the claim's)
    commit = events.index(f"commit {MANIFEST_NAME}")
    assert sorted(events[:commit]) == sorted(manifest.files)  # every data file synced, before the commit
    assert all(name.startswith(f".{MANIFEST_NAME}.") for name in events[commit + 1 :])  # then only its own temp file
