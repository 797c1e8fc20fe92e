"""Tier 0's policy pieces (tiers/tier0.py): K from measured times, the schedule, retention."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name
from lightning_preempt.tiers.tier0 import Tier0Schedule, choose_every, committed_steps, tier0_root, to_prune


def test_k_keeps_the_overhead_within_one_percent() -> None:
    assert choose_every(0.05, 0.1) == 50  # 0.05 s copy over 50 steps of 0.1 s: exactly 1 %
    assert choose_every(0.051, 0.1) == 51
    assert choose_every(0.0, 0.1) == 1
    k = choose_every(0.3, 0.25)
    assert 0.3 / (k * 0.25) <= 0.01
    with pytest.raises(ValueError, match="HINT"):
        choose_every(0.1, 0.0)


def test_schedule_never_starts_a_copy_while_one_runs() -> None:
    s = Tier0Schedule(every=None)
    assert s.due(1)  # auto: the first copy measures
    s.busy = True
    assert not s.due(2)
    assert s.measured(copy_s=0.02, step_s=0.1) == 20
    assert [n for n in range(1, 61) if s.due(n)] == [20, 40, 60]
    with pytest.raises(ValueError, match="HINT"):
        Tier0Schedule(every=0)


def test_root_is_one_directory_per_run() -> None:
    assert tier0_root("abc123", "/dev/shm/lp/") == "/dev/shm/lp/abc123"
    with pytest.raises(ValueError, match="HINT"):
        tier0_root("../etc")


def _ckpt(root: Path, step: int, committed: bool) -> Path:
    d = root / checkpoint_name(step)
    d.mkdir(parents=True)
    if committed:
        (d / MANIFEST_NAME).write_bytes(Manifest(step=step, epoch=0, world_size=1, files={}).to_json())
    return d


def test_retention_keeps_the_newest_two_and_drops_torn_copies(tmp_path: Path) -> None:
    paths = {s: _ckpt(tmp_path, s, committed=s != 30) for s in (10, 20, 30, 40, 50, 60)}
    torn_newest = _ckpt(tmp_path, 70, committed=False)  # a copy in flight: not ours to touch yet
    assert committed_steps(str(tmp_path)) == [10, 20, 40, 50, 60]
    pruned = {Path(p).name for p in to_prune(str(tmp_path), keep=2)}
    assert pruned == {paths[s].name for s in (10, 20, 30, 40)}
    assert torn_newest.name not in pruned
    assert to_prune(str(tmp_path / "absent")) == []


def test_the_default_memory_root_is_stable_per_dirpath_and_names_a_directory() -> None:
    from lightning_preempt.tiers.tier0 import default_memory_root

    a = default_memory_root("gs://bucket/run-7/")
    assert a == default_memory_root("gs://bucket/run-7")  # the same on every restart
    assert a.startswith("/dev/shm/lightning_preempt/run-7-") and "/" not in a[len("/dev/shm/lightning_preempt/") :]
    assert default_memory_root("gs://other/run-7") != a  # two jobs, one name: two directories


def test_tier0_options_are_validated_and_default_to_dev_shm() -> None:
    from lightning_preempt.engine.config import PreemptionConfig
    from lightning_preempt.engine.ledger_writer import start_fields

    config = PreemptionConfig(dirpath="ckpts/run", tier0_every_n_steps=4)
    assert config.memory_dirpath is not None and config.memory_dirpath.startswith("/dev/shm/lightning_preempt/run-")
    assert PreemptionConfig(dirpath="ckpts/run").memory_dirpath is None  # no tier 0, no directory
    with pytest.raises(ValueError, match=r"(?s)tier0_every_n_steps must be an int >= 1.*HINT: "):
        PreemptionConfig(dirpath="ckpts/run", tier0_every_n_steps=0)
    with pytest.raises(ValueError, match="memory_dirpath must be a local directory"):
        PreemptionConfig(dirpath="ckpts/run", tier0_every_n_steps=4, memory_dirpath="s3://b/x")
    fields = start_fields(
        8, config.memory_dirpath + "/step-0000000008", 1, config, memory_dirpath=config.memory_dirpath
    )
    assert fields["resumed_tier"] == "memory"
    assert (
        start_fields(5, "ckpts/run/step-0000000005", 1, config, memory_dirpath=config.memory_dirpath)["resumed_tier"]
        == "dirpath"
    )
