"""Fault matrix: every multi-rank decision of the protocol, with storage failing on a chosen
set of ranks, in real processes over gloo (2 and 4 ranks).

For each protocol phase (list, choose, probe, lease, exists, makedirs, write, commit, rm,
retention, drain) the ``chaos://`` filesystem fails one operation on the failing ranks only.
Each case asserts that every rank ends the phase with the *same* outcome (the same error,
or the same success) within a bound far below any process-group timeout, that a failed
save committed nothing, and that no thread of ours is left after teardown. In the style of
DCP's ``FaultyStorageWriter``: the real code, with the storage underneath failing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ranks import run_ranks

pytestmark = pytest.mark.multiproc
PHASE_BOUND_S = 45.0  # the groups' timeout is 120 s; a hang shows up as a phase past this
# (phase, chaos op, which ranks perform the op, does a failure stop the phase)
PHASES: list[tuple[str, str, str, bool]] = [
    ("list", "list", "all", True),
    ("choose", "read", "rank0", True),
    ("probe", "write", "all", True),
    ("lease", "commit", "rank0", True),
    ("exists", "exists", "all", True),
    ("makedirs", "makedirs", "all", True),
    ("write", "write", "all", True),
    ("commit", "commit", "rank0", True),
    ("rm", "rm", "rank0", True),
    ("retention", "rm", "rank0", False),  # logged; training goes on; nothing is deleted
    ("drain", "write", "all", False),  # logged; the local tier holds the checkpoint
]


def _run_phase(phase: str, url: str, local: str, group: Any, io: Any, tiers_io: Any) -> str:
    from ckpts import lightning_like_checkpoint

    from lightning_preempt.catalog.retention import apply_retention
    from lightning_preempt.collective import agree
    from lightning_preempt.collective import groups as pdist
    from lightning_preempt.resume.resolver import ResumeResolver
    from lightning_preempt.save.lease import Lease
    from lightning_preempt.save.preflight import check_writable

    resolver = ResumeResolver(url, {}, retries=2, backoff_s=0.01)
    if phase == "list":
        resolver.peek()
        return f"ok {resolver.agree_on_peeks(group)}"
    if phase == "choose":  # rank 0 verifies the candidates while choosing
        return f"ok {Path(resolver.choose(group, tiers=None, verify=True).path).name}"
    if phase == "probe":
        agree.agree(lambda: check_writable(url), group, what="probing the storage")
        return "ok"
    if phase == "lease":
        lease = Lease(url, timeout_s=5)
        agree.decide(lease.acquire, group, what="taking the lease")
        return "ok"
    if phase == "retention":
        io.save_checkpoint(lightning_like_checkpoint(step=4), f"{url}/step-0000000004")

        def retention() -> None:
            try:
                apply_retention(url, 1, {})
            except Exception as err:  # what the callback's retention job does: log, keep going
                print(f"retention failed: {err}", file=sys.stderr)

        if pdist.rank(group) == 0:  # rank 0 queues retention behind the save, as the callback does
            io.submit(retention)
        agree.agree(io.wait, group, what="saving the checkpoint")
        return "ok"
    if phase == "drain":
        tiers_io.save_checkpoint(lightning_like_checkpoint(step=6), f"{url}/step-0000000006")
        agree.agree(tiers_io.wait, group, what="saving the checkpoint")
        finished = tiers_io.wait_drained(30)
        return f"ok drained={finished}"
    # exists, makedirs, write, commit, rm: one collective save, then the agreed wait
    io.save_checkpoint(lightning_like_checkpoint(step=7), f"{url}/step-0000000007")
    agree.agree(io.wait, group, what="saving the checkpoint")
    return "ok"


def _worker(rank: int, world: int, root: str, ctl: str, failing: list[int], out: str) -> None:
    import os

    os.environ["RANK"] = str(rank)
    os.environ["LP_CHAOS_DIR"] = ctl
    import threading

    import chaos_fs
    import torch.distributed as dist

    from lightning_preempt.collective import groups as pdist
    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    group = pdist.new_gloo_group(timeout_s=120)
    io = ShardedAsyncCheckpointIO()
    io.enable_collective_saves(pdist.new_gloo_group(timeout_s=120))
    tiers_io = ShardedAsyncCheckpointIO()
    tiers_io.saver.use_local_tier(f"{root}/drain-local", retries=2, backoff_s=0.01)
    tiers_io.enable_collective_saves(pdist.new_gloo_group(timeout_s=120))
    tiers_io.set_tiers(f"chaos://{root}/drain", keep_last_n=2, group=pdist.new_gloo_group(timeout_s=120))
    results: dict[str, Any] = {}
    for phase, op, _, _ in PHASES:
        url = f"chaos://{root}/{phase}"
        dist.barrier()
        if rank == 0:
            chaos_fs.set_fault(ctl, op, ranks=failing)
        dist.barrier()
        started = time.monotonic()
        try:
            outcome = _run_phase(phase, url, f"{root}/drain-local", group, io, tiers_io)
        except Exception as err:
            outcome = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        seconds = time.monotonic() - started
        dist.barrier()
        if rank == 0:
            chaos_fs.clear_faults(ctl)
        results[phase] = {"outcome": outcome, "seconds": seconds}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    io.teardown()
    tiers_io.teardown()
    results["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("lightning_preempt")]
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _prepare(root: Path) -> None:
    """Committed checkpoints that the list/choose/retention phases find, and a leftover for rm."""
    from ckpts import lightning_like_checkpoint

    from lightning_preempt.lightning.checkpoint_io import ShardedAsyncCheckpointIO

    io = ShardedAsyncCheckpointIO()
    for phase, steps in (("list", [2]), ("choose", [2]), ("retention", [1, 2, 3])):
        for step in steps:
            io.save_checkpoint(lightning_like_checkpoint(step=step), str(root / phase / f"step-{step:010d}"))
    io.teardown()
    leftover = root / "rm" / "step-0000000007"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"partial")  # an uncommitted earlier attempt


CASES = [
    pytest.param(2, [1], id="2ranks-fail1"),
    pytest.param(4, [0], id="4ranks-fail0"),
    pytest.param(2, [0], id="2ranks-fail0", marks=pytest.mark.slow),
    pytest.param(2, [0, 1], id="2ranks-failall", marks=pytest.mark.slow),
    pytest.param(4, [3], id="4ranks-fail3", marks=pytest.mark.slow),
    pytest.param(4, [1, 2], id="4ranks-fail12", marks=pytest.mark.slow),
    pytest.param(4, [0, 1, 2, 3], id="4ranks-failall", marks=pytest.mark.slow),
    pytest.param(2, [], id="2ranks-nofault", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("world", "failing"), CASES)
def test_every_rank_ends_each_phase_alike(tmp_path: Path, world: int, failing: list[int]) -> None:
    root, ctl, out = tmp_path / "root", tmp_path / "ctl", tmp_path / "out"
    for d in (root, ctl, out):
        d.mkdir()
    _prepare(root)

    def phases_done() -> str:
        done = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        return f"; phases finished per rank: {[list(d) for d in done]}"

    run_ranks(
        _worker, world, tmp_path, str(root), str(ctl), failing, str(out),
        timeout_s=PHASE_BOUND_S * 2 + 30 * world, on_hang=phases_done,
    )  # fmt: skip
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for phase, _, actors, stops in PHASES:
        outcomes = {r: per_rank[r][phase]["outcome"] for r in range(world)}
        assert len(set(outcomes.values())) == 1, f"{phase}: ranks disagree: {outcomes}"
        outcome = outcomes[0]
        hit = bool(failing) and (actors == "all" or 0 in failing)
        if hit and stops:
            assert not outcome.startswith("ok"), f"{phase}: the fault on ranks {failing} was not noticed"
            assert "HINT:" not in outcome  # first line only; every error of ours carries a HINT below it
        else:
            assert outcome.startswith("ok"), f"{phase}: {outcome}"
        assert max(per_rank[r][phase]["seconds"] for r in range(world)) < PHASE_BOUND_S, phase
    # nothing partial is committed: the failed saves left no manifest
    for phase in ("exists", "makedirs", "write", "commit", "rm"):
        committed = (root / phase / "step-0000000007" / "manifest.json").exists()
        assert committed == (not failing or (PHASES_BY_NAME[phase][2] == "rank0" and 0 not in failing)), phase
    retained = sorted(p.name for p in (root / "retention").iterdir() if (p / "manifest.json").exists())
    assert retained == (["step-0000000004"] if 0 not in failing else [f"step-{s:010d}" for s in (1, 2, 3, 4)])
    drained = (root / "drain" / "step-0000000006" / "manifest.json").exists()
    assert drained == (not failing)
    assert (root / "drain-local" / "step-0000000006" / "manifest.json").exists()
    for r in range(world):
        assert per_rank[r]["threads"] == [], f"rank {r} left threads: {per_rank[r]['threads']}"


PHASES_BY_NAME = {p[0]: p for p in PHASES}
