"""Saves of an unchanged structure replay the last plan's file layout and reuse its pickled
``.metadata`` entries (write/records.py, write/dcp_metadata.py): the same shard bytes
as a save made item by item, a ``.metadata`` every reader takes, the values of *this* save."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpts import assert_loads_both_ways
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import DCP_METADATA_NAME, MANIFEST_NAME
from lightning_preempt.format.pickles.metadata import check_metadata_pickle
from lightning_preempt.read.load import load_full_checkpoint
from lightning_preempt.save.order import SaveOrder
from lightning_preempt.save.saver import Saver
from lightning_preempt.storage.store import Store
from lightning_preempt.write import records


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    tensors = {f"w{i}": torch.randn(3, 4, generator=gen) for i in range(40)}
    tensors["big"] = torch.randn(64, 64, generator=gen)  # over the (lowered) template size: torch.save
    tensors["half"] = torch.randn(5, 2, generator=gen).to(torch.bfloat16)  # no numpy dtype
    tensors["count"] = torch.tensor(step, dtype=torch.int64)  # 0-dim
    return {"state_dict": tensors, "optimizer_states": [], "global_step": step, "epoch": 0}


def _files(url: str) -> dict[str, bytes]:
    root = Path(url)
    return {p.name: p.read_bytes() for p in root.iterdir() if p.name.endswith(".distcp")}



def test_a_replayed_save_writes_what_an_item_by_item_save_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "TEMPLATE_MAX_BYTES", 4096)
    saver = Saver({})
    try:
        for step in (1, 2, 3):  # 1 plans and records the layout; 2 and 3 replay it
            saver.save(_state(step), SaveOrder(str(tmp_path / f"s{step}")), wait=True)
    finally:
        saver.close()
    assert saver.plan_cache.hits["local"] == 2
    assert saver.plan_cache.records is not None
    assert saver.plan_cache.metadata_pickles.hits == 2

    fresh = Saver({})  # the same state written item by item (no plan to replay)
    try:
        fresh.save(_state(3), SaveOrder(str(tmp_path / "fresh")), wait=True)
    finally:
        fresh.close()
    assert fresh.plan_cache.metadata_pickles.hits == 0
    assert _files(str(tmp_path / "s3")) == _files(str(tmp_path / "fresh"))

    for step in (1, 2, 3):
        url = str(tmp_path / f"s{step}")
        assert_loads_both_ways(url, _state(step))
        data = (Path(url) / DCP_METADATA_NAME).read_bytes()
        metadata = pickle.loads(data)
        assert metadata.storage_meta.checkpoint_id == url  # this save's own path, not the last one's
        reference = pickle.loads((tmp_path / "fresh" / DCP_METADATA_NAME).read_bytes())
        assert metadata.state_dict_metadata == reference.state_dict_metadata
        assert metadata.storage_data == reference.storage_data
        assert metadata.version == reference.version
        # the planner skips DCP's flattening of a flat dict: the mapping DCP's own would make
        flat = {f"state_dict/{k}": v for k, v in _state(step)["state_dict"].items()}
        assert metadata.planner_data == flatten_state_dict(flat)[1]
        manifest = Manifest.from_json((Path(url) / MANIFEST_NAME).read_bytes(), path=url)
        check_metadata_pickle(data, path=url, manifest=manifest)  # the CLI's torch-free check


def test_a_torch_save_record_of_another_length_moves_the_places_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record written by torch.save is checked, not assumed, to keep its length."""
    monkeypatch.setattr(records, "TEMPLATE_MAX_BYTES", 4096)
    saver = Saver({})
    try:
        saver.save(_state(1), SaveOrder(str(tmp_path / "a")), wait=True)
        layout = saver.plan_cache.records
        assert layout is not None
        position = next(i for i, e in enumerate(layout.files[0]) if e.head is None)
        # as if torch.save had written a record 8 bytes shorter last time
        layout.files[0][position] = layout.files[0][position]._replace(length=layout.files[0][position].length - 8)
        saver.save(_state(2), SaveOrder(str(tmp_path / "b")), wait=True)
    finally:
        saver.close()
    assert saver.plan_cache.hits["local"] == 1
    assert_loads_both_ways(str(tmp_path / "b"), _state(2))


def test_replayed_saves_to_an_object_store_write_one_buffered_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """No file descriptor to gather writes on (memory://): the replay writes through the buffer."""
    monkeypatch.setattr(records, "TEMPLATE_MAX_BYTES", 4096)
    saver = Saver({})
    urls = [f"memory://lp-replay/s{step}" for step in (1, 2, 3)]
    try:
        for step, url in zip((1, 2, 3), urls, strict=True):
            saver.save(_state(step), SaveOrder(url), wait=True)
    finally:
        saver.close()
    assert saver.plan_cache.hits["local"] == 2
    for step, url in zip((1, 2, 3), urls, strict=True):
        loaded = load_full_checkpoint(Store(url))  # CRC32C verified
        for key, tensor in _state(step)["state_dict"].items():
            assert torch.equal(loaded["state_dict"][key], tensor), key
