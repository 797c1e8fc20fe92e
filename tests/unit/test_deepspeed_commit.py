"""DeepSpeed's own files committed by our manifest (lightning/deepspeed.py), without DeepSpeed:
its file names, the shared commit (write/commit.py ``commit_written``), verification,
retention, and the refusals. The real thing on 2 ranks: tests/multiproc/test_deepspeed.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from ckpts import committed, flip_byte

from lightning_preempt import ShardedAsyncCheckpointIO
from lightning_preempt.catalog.retention import apply_retention
from lightning_preempt.errors import CheckpointError, CorruptCheckpointError
from lightning_preempt.format.names import is_checkpoint_file, is_our_file, writer_of
from lightning_preempt.lightning import deepspeed as ds_glue
from lightning_preempt.read.verify import read_manifest, verify_checkpoint
from lightning_preempt.storage.store import Store
from lightning_preempt.write.commit import commit_written, prepare_path

ZERO3 = ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
ZERO12 = ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_3_mp_rank_01_optim_states.pt"]


def test_deepspeeds_file_names_are_checkpoint_files_and_nothing_else() -> None:
    for name in ZERO3 + ZERO12:
        assert is_checkpoint_file(name) and is_our_file(name), name
    assert [writer_of(n) for n in ZERO3 + ZERO12] == [0, 1, 0, 3]
    for name in ["latest", "zero_to_fp32.py", "zero_pp_rank_0_mp_rank_00_model_states.pt.tmp", "x_mp_rank_00_model_states.pt"]:
        assert not is_checkpoint_file(name), name


def _deepspeed_like(root: Path, step: int) -> Path:
    """A checkpoint as lightning/deepspeed.py commits one: files written into the prepared
    directory by "DeepSpeed", then their entries (read back) committed."""
    store = Store(str(root / f"step-{step:010d}"))
    plan = prepare_path(store, None)
    paths = []
    for name in ZERO3:
        path = Path(plan.data(store).path()) / name
        path.write_bytes(bytes(range(256)) * (step + 1))
        paths.append(str(path))
    commit_written(store, plan, lambda: ds_glue._checksum(paths), group=None, step=step, epoch=0)
    return Path(store.path())


def test_committed_files_verify_retention_deletes_them_and_a_flipped_byte_fails(tmp_path: Path) -> None:
    first, second = _deepspeed_like(tmp_path, 4), _deepspeed_like(tmp_path, 8)
    manifest = verify_checkpoint(Store(str(second)))
    assert sorted(manifest.files) == sorted(ZERO3)
    assert manifest.files[ZERO3[0]].size == 256 * 9
    assert committed(tmp_path) == [8, 4]
    assert apply_retention(str(tmp_path), 1) and not first.exists()  # DeepSpeed's files are ours to delete
    flip_byte(second / ZERO3[1])
    verify_checkpoint(Store(str(second)), share=(0, 2))  # rank 0's share: the other file
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        verify_checkpoint(Store(str(second)), share=(1, 2))
    assert read_manifest(Store(str(second))).step == 8


def test_an_unknown_file_is_not_committed(tmp_path: Path) -> None:
    stray = tmp_path / "zero_to_fp32.py"
    stray.write_text("")
    with pytest.raises(CheckpointError, match="does not know"):
        ds_glue._checksum([str(stray)])


def test_two_tiers_and_a_remote_dirpath_are_refused_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"HINT: DeepSpeed writes its files with torch\.save"):
        io = ShardedAsyncCheckpointIO()
        io.saver.use_local_tier(str(tmp_path))  # PreemptionCallback(local_dirpath=...) hands it so
        ds_glue.install(object(), io)
    saves = ds_glue._Saves(ShardedAsyncCheckpointIO())
    with pytest.raises(CheckpointError, match="cannot save to memory"):
        saves.save(object(), {}, "memory://bucket/step-0000000005", None)
