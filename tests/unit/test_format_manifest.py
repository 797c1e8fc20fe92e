"""Unit tests: checkpoint splitting and the manifest."""

from __future__ import annotations

import json

import pytest
import torch
from ckpts import assert_same, lightning_like_checkpoint

from lightning_preempt.errors import CorruptCheckpointError, UnsupportedFormatError
from lightning_preempt.format.manifest import FileEntry, Manifest
from lightning_preempt.format.skeleton import NEXT_REF, REFS_KEY, merge_checkpoint, split_checkpoint, tensor_refs


def test_split_sends_model_and_optimizer_tensors_to_dcp_and_keeps_the_rest() -> None:
    ckpt = lightning_like_checkpoint()
    tensors, skeleton = split_checkpoint(ckpt)
    assert set(tensors) == {
        "state_dict/weight",
        "state_dict/bias",
        "optimizer_states/0/state/0/step",
        "optimizer_states/0/state/0/exp_avg",
        "optimizer_states/0/state/0/exp_avg_sq",
        "optimizer_states/0/state/1/step",
        "optimizer_states/0/state/1/exp_avg",
        "optimizer_states/0/state/1/exp_avg_sq",
    }
    assert skeleton["state_dict"]["weight"] == NEXT_REF  # one placeholder; the keys listed once, in walk order
    assert tensor_refs(skeleton) == list(tensors) and skeleton[REFS_KEY] == "\n".join(tensors)
    # Per-rank values stay in the skeleton, as real tensors.
    assert isinstance(skeleton["rng"], torch.Tensor)
    assert isinstance(skeleton["callbacks"]["Cb"]["best"], torch.Tensor)


def test_merge_restores_int_keys_empty_containers_tuples_and_ordered_dicts() -> None:
    ckpt = lightning_like_checkpoint()
    tensors, skeleton = split_checkpoint(ckpt)
    merged = merge_checkpoint(skeleton, {k: v.clone() for k, v in tensors.items()})
    assert_same(ckpt, merged)
    assert type(merged["state_dict"]) is type(ckpt["state_dict"])
    assert list(merged["optimizer_states"][0]["state"]) == [0, 1]


def test_colliding_keys_get_distinct_flat_names() -> None:
    ckpt = {"state_dict": {0: torch.ones(1), "0": torch.zeros(1)}}
    tensors, skeleton = split_checkpoint(ckpt)
    assert len(tensors) == 2
    merged = merge_checkpoint(skeleton, tensors)
    assert torch.equal(merged["state_dict"][0], torch.ones(1))
    assert torch.equal(merged["state_dict"]["0"], torch.zeros(1))


def _manifest() -> Manifest:
    return Manifest(step=7, epoch=1, world_size=2, files={"a": FileEntry(3, "0000abcd")}, stats={"write_s": 1.5})


def test_manifest_round_trips_through_json() -> None:
    m = _manifest()
    back = Manifest.from_json(m.to_json(), path="x")
    assert back == m
    assert back.total_bytes == 3


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda b: b"{not json", CorruptCheckpointError),
        (lambda b: json.dumps({**json.loads(b), "version": 999}).encode(), UnsupportedFormatError),
        (lambda b: json.dumps({**json.loads(b), "format": "other"}).encode(), CorruptCheckpointError),
        (
            lambda b: json.dumps({k: v for k, v in json.loads(b).items() if k != "files"}).encode(),
            CorruptCheckpointError,
        ),
    ],
    ids=["garbage", "newer-version", "foreign-format", "missing-field"],
)
def test_bad_manifests_raise_with_path_and_hint(mutate, error) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error) as info:
        Manifest.from_json(mutate(_manifest().to_json()), path="gs://b/run/step-7")
    assert "gs://b/run/step-7" in str(info.value)
    assert "HINT:" in str(info.value)


def test_version_3_is_written_versions_1_and_2_still_read_and_4_is_too_new() -> None:
    """0.2.0's inline tensors made the format version 2: a 0.1 reader says "upgrade" instead
    of refusing the state files as untrusted; the skeleton's listed keys (format/skeleton.py)
    made it 3, for the same reason. Older manifests still load."""
    from pathlib import Path

    from lightning_preempt.format.manifest import FORMAT_VERSION

    written = json.loads(Manifest(step=3, epoch=0, world_size=1, files={}).to_json())
    assert written["version"] == FORMAT_VERSION == 3
    old = Path(__file__).parents[1] / "data" / "v0_2" / "run" / "step-0000000003" / "manifest.json"
    body = json.loads(old.read_text())
    assert body["version"] == 1
    parsed = Manifest.from_json(old.read_bytes(), path=str(old))
    assert parsed.version == 1 and parsed.step == 3
    assert Manifest.from_json(json.dumps({**body, "version": 2}).encode(), path=str(old)).version == 2
    with pytest.raises(UnsupportedFormatError, match="reads up to 3"):
        Manifest.from_json(json.dumps({**body, "version": 4}).encode(), path=str(old))
