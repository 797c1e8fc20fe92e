"""'Could not tell' is never 'absent': a manifest that cannot be statted (EIO on NFS/FUSE)
neither restarts training from step 0 nor lets retention delete its checkpoint (issue 20, 3).

EIO is simulated (:class:`faulty_fs.FailingStat`): nothing else on a test machine makes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpts import committed
from faulty_fs import FailingStat
from trainers import fit

from lightning_preempt import Tuning
from lightning_preempt.catalog.retention import apply_retention, retain
from lightning_preempt.format.names import MANIFEST_NAME, checkpoint_name
from lightning_preempt.resume.resolver import ListingError
from lightning_preempt.storage.store import STAT_BACKOFF, Store, kind_at


def _manifest_of(step: int) -> str:
    return f"{checkpoint_name(step)}/{MANIFEST_NAME}"


def test_two_eios_on_the_manifest_still_resume_from_the_newest_step(tmp_path: Path) -> None:
    first = fit(tmp_path, max_steps=10, every=10)
    weights_at_10 = {k: v.clone() for k, v in first.model.state_dict().items()}
    with FailingStat(_manifest_of(10), times=2) as eio:
        probe = fit(tmp_path, max_steps=20, every=10, seed=123).probe
    assert eio.failed == 2
    assert probe.start_step == 10  # was 0: the manifest looked absent, the run started over
    for k, v in weights_at_10.items():
        assert torch.equal(probe.start_weights[k], v), k
    assert committed(tmp_path) == [20, 10]


def test_a_manifest_that_never_answers_stops_the_run_before_step_1(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=10, every=10)
    with FailingStat(_manifest_of(10)), pytest.raises(ListingError) as info:
        fit(tmp_path, max_steps=20, every=10, seed=123, tuning=Tuning(retries=2))
    text = str(info.value)
    assert "cannot list" in text and "Input/output error" in text and "\nHINT: Training did not start" in text
    assert committed(tmp_path) == [10]  # nothing trained from scratch, nothing deleted


def test_retention_never_deletes_a_checkpoint_whose_manifest_cannot_be_statted(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=30, every=10, keep_last_n=5)
    assert committed(tmp_path) == [30, 20, 10]
    with FailingStat(_manifest_of(10)):
        # as the engine runs it after a commit: logged, never raised
        assert retain(str(tmp_path), 5) == []
        with pytest.raises(OSError, match="Input/output error"):
            apply_retention(str(tmp_path), 5)
    assert committed(tmp_path) == [30, 20, 10]  # was [30, 20]: step 10 deleted as "no manifest (partial save)"
    assert apply_retention(str(tmp_path), 1) == [str(tmp_path / checkpoint_name(n)) for n in (20, 10)]


def test_stat_says_absent_only_when_the_store_says_so(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    store = Store(str(tmp_path))
    assert store.stat("nope") is None and store.stat("a/b") is None and kind_at(store, "a") == "file"
    with FailingStat("/a", times=STAT_BACKOFF.attempts - 1) as eio:
        assert kind_at(store, "a") == "file"  # a short blip is retried
    assert eio.failed == STAT_BACKOFF.attempts - 1
    with FailingStat("/a") as eio, pytest.raises(OSError, match="Input/output error"):
        store.stat("a")
    assert eio.failed == STAT_BACKOFF.attempts
    with FailingStat("/a", errno_=13) as eio, pytest.raises(PermissionError):
        kind_at(store, "a")
    assert eio.failed == 1  # a retry cannot fix a permission: raised at once
