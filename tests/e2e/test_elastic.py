"""Elastic runs under torchrun (docs/elastic.md): real agents, real c10d rendezvous, gloo.

Each test simulates nodes as torchrun agents on this machine (``elastic_cluster.py``): one
rank per agent, a shared ``dirpath``. A node leaving (SIGTERM to its agent) and a node
joining must each lose 0 steps; the tests assert the step every worker resumed at, the
world size, the weights (bitwise, against the snapshot the previous workers held at exit)
and the exit codes the scheduler sees.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpts import committed
from elastic_cluster import Cluster
from elastic_script import state_sha

from lightning_preempt.elastic import ElasticEnv, exit_code_for, trainer_kwargs

pytestmark = pytest.mark.multiproc


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[type[Cluster]]:
    made: list[Cluster] = []

    def make(**kwargs: object) -> Cluster:
        c = Cluster(tmp_path, **kwargs)  # type: ignore[arg-type]
        made.append(c)
        c.start_store()
        return c

    yield make  # type: ignore[misc]
    for c in made:
        c.close()


# ---- unit: the wrapper's pieces -----------------------------------------------------------------
def test_trainer_kwargs_follow_the_world_of_this_restart() -> None:
    env = {"TORCHELASTIC_RUN_ID": "j", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "4"}
    assert trainer_kwargs(env) == {"devices": 2, "num_nodes": 3}
    info = ElasticEnv.from_environ(env)
    assert info is not None and info.restart_count == 4 and info.run_id == "j"
    assert trainer_kwargs({"WORLD_SIZE": "2"}) == {}  # not torchrun: Lightning's defaults


def test_exit_codes_a_scheduler_sees() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    assert exit_code_for(SignalException("x", sigval=signal.SIGTERM)) == 143
    assert exit_code_for(SignalException("x", sigval=signal.SIGINT)) == 130

    def failed(code: int) -> ChildFailedError:
        return ChildFailedError("train.py", {0: ProcessFailure(local_rank=0, pid=1, exitcode=code, error_file="")})

    assert exit_code_for(failed(143)) == 143  # the workers' own preemption exit
    assert exit_code_for(failed(-9)) == 137  # a worker killed by SIGKILL
    assert exit_code_for(failed(2)) == 2
    assert exit_code_for(RuntimeError("rendezvous closed")) == 1


# ---- real agents ------------------------------------------------------------------------------
def test_node_loss_survivor_goes_on_at_n_minus_1_losing_no_step(cluster_factory: type[Cluster]) -> None:
    c = cluster_factory(nnodes="1:2", script_args=("--max-steps", "40"))
    c.start("A")
    c.start("B")
    # Under load one agent joins a round late: the first world is then of 1 node, and every node
    # restarts (a snapshot, exit 143) when the other joins (a CI run saw it): wait for 2.
    began = c.wait_world("AB", 2)
    c.wait_step("B", began + 3)
    c.preempt("B")

    assert c.wait("B") == 143, c.log("B")  # the scheduler sees a preemption (plain torchrun: 1)
    assert c.wait("A") == 0, c.log("A")

    b_exit = c.records("B", "exit")[-1]
    a_first, a_second = c.records("A", "exit")[-2:]
    snapshot = b_exit["step"]
    assert b_exit["code"] == 143 and a_first["code"] == 143  # both ranks snapshot the agreed step
    assert a_first["step"] == snapshot and a_first["weights"] == b_exit["weights"]
    assert snapshot in committed(c.dirpath)

    before, after = c.records("A", "start")[-2:]
    assert before["world_size"] == 2 and after["world_size"] == 1
    assert after["start_step"] == snapshot  # 0 steps lost
    assert after["weights"] == a_first["weights"]  # bitwise: the resharded load is the snapshot
    assert after["restart_count"] == before["restart_count"] + 1  # a failure restart (counts against --max-restarts)
    assert a_second["code"] == 0 and a_second["step"] == 40


@pytest.mark.slow  # N+1; the N-1 case above stays in every run
def test_node_join_restarts_at_n_with_a_snapshot(cluster_factory: type[Cluster]) -> None:
    c = cluster_factory(nnodes="1:2", script_args=("--max-steps", "100000"))
    c.start("A")
    c.wait_step("A", 5)
    c.start("B")  # the reclaimed node is back: the running worker is restarted with SIGTERM

    a_starts = c.wait_starts("A", 2)
    (b_start,) = c.wait_starts("B", 1)
    (a_exit,) = c.records("A", "exit")
    assert a_exit["code"] == 143  # the join's SIGTERM took a snapshot like a preemption
    for start in (a_starts[1], b_start):
        assert start["world_size"] == 2
        assert start["start_step"] == a_exit["step"]  # 0 steps lost
        assert start["weights"] == a_exit["weights"]  # bitwise, on both ranks
    assert a_starts[1]["restart_count"] == 0  # a membership change does not use up a restart
    assert {a_starts[1]["rank"], b_start["rank"]} == {0, 1}

    c.wait_step("B", a_exit["step"] + 3)  # training again at N
    for name in ("A", "B"):  # the job ends like any preempted one
        c.preempt(name)
    assert c.wait("A") == 143 and c.wait("B") == 143
    ends = [c.records(n, "exit")[-1] for n in ("A", "B")]
    assert ends[0]["step"] == ends[1]["step"] and ends[0]["weights"] == ends[1]["weights"]
    assert ends[0]["step"] in committed(c.dirpath)


@pytest.mark.slow
def test_plain_torchrun_reports_a_preempted_node_as_exit_1(cluster_factory: type[Cluster]) -> None:
    """Why the wrapper exists: torch.distributed.run re-raises the agent's SignalException.

    If this starts to fail, torch fixed it: docs/elastic.md can drop the wrapper's reason."""
    c = cluster_factory(nnodes="1:2", script_args=("--max-steps", "40"))
    c.start("A")
    c.start("B", launcher="torchrun", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    c.wait_step("B", 5)
    c.preempt("B")
    assert c.wait("B") == 1
    assert c.records("B", "exit")[0]["code"] == 143  # its worker did exit with the preemption code
    assert c.wait("A") == 0


def _two_tier_node_loss(cluster_factory: type[Cluster], tmp_path: Path, *, replica: bool) -> tuple[Cluster, int]:
    """Separate node-local tiers; the remote's bandwidth drops so that no rank's share can be
    uploaded within the 6 s grace; SIGTERM to node B, whose disk is then wiped. Returns the
    cluster and the step of the snapshot (both ranks exited 143 at it)."""
    import shutil

    from throttled_fs import set_rate

    slow = tmp_path / "slow"
    args = ("--max-steps", "25", "--every", "10", "--grace", "6", *(("--replica",) if replica else ()))
    c = cluster_factory(nnodes="1:2", url_prefix="slow://", script_args=args)
    env = {"LP_SLOW_DIR": str(slow)}
    c.start("A", env=env, extra=("--local-dirpath", str(tmp_path / "local-A")))
    c.start("B", env=env, extra=("--local-dirpath", str(tmp_path / "local-B")))
    c.wait_step("B", 12)
    deadline_ok = c.wait_step("A", 12)
    assert deadline_ok >= 12
    # The step-10 save must be in the bucket before the bandwidth drops: on a loaded machine
    # its drain can still be running at step 12 (then it would never arrive, and nothing would).
    drained = time.monotonic() + 120
    while 10 not in committed(c.dirpath):
        assert time.monotonic() < drained, "the step-10 checkpoint never reached the bucket"
        time.sleep(0.2)
    # 5 kB/s: a rank's ~50 kB share needs ~10 s, longer than the 6 s grace.
    set_rate(slow, 5_000)
    c.preempt("B")
    assert c.wait("B") == 143, c.log("B")
    shutil.rmtree(tmp_path / "local-B")  # the node is gone, and its disk with it
    set_rate(slow, 0)
    assert c.wait("A") == 0, c.log("A")
    (b_exit,) = c.records("B", "exit")
    snapshot = b_exit["step"]
    a_exit = c.records("A", "exit")[0]
    assert b_exit["code"] == 143 and a_exit["code"] == 143 and a_exit["step"] == snapshot
    return c, snapshot


@pytest.mark.slow
def test_two_tier_node_loss_with_a_slow_remote_falls_back_to_the_bucket(
    cluster_factory: type[Cluster], tmp_path: Path
) -> None:
    """Without a peer replica the snapshot is lost with the node and the survivor resumes from
    the newest checkpoint in the bucket: today's limit of plain two tiers across nodes
    (docs/elastic.md, "Two tiers across nodes"), the comparison for the replica below."""
    from lightning_preempt import ShardedAsyncCheckpointIO

    c, snapshot = _two_tier_node_loss(cluster_factory, tmp_path, replica=False)
    after = c.records("A", "start")[-1]
    assert after["world_size"] == 1
    resumed = after["start_step"]
    assert 10 <= resumed < snapshot  # the snapshot never reached the bucket: steps lost
    assert resumed in committed(c.dirpath)
    ckpt = ShardedAsyncCheckpointIO().load_checkpoint(str(c.dirpath / f"step-{resumed:010d}"))
    assert after["weights"] == state_sha(ckpt["state_dict"])  # bitwise: what the bucket holds
    # The survivor's own disk held the snapshot only in part (its rank's files).
    local = tmp_path / "local-A" / f"step-{snapshot:010d}"
    assert not local.exists() or not (local / "__1_0.distcp").exists()


@pytest.mark.slow
def test_two_tier_node_loss_with_the_peer_replica_loses_no_step(cluster_factory: type[Cluster], tmp_path: Path) -> None:
    """With ``PeerReplica`` the leaving node's share reached the survivor's disk before the
    exit: the survivor resumes from its own local tier at the snapshot (0 steps lost, bitwise)
    and its upload-on-start drains the snapshot to the bucket."""
    from lightning_preempt.catalog.listing import complete_local_checkpoints

    c, snapshot = _two_tier_node_loss(cluster_factory, tmp_path, replica=True)
    after = c.records("A", "start")[-1]
    assert after["world_size"] == 1
    assert after["start_step"] == snapshot  # 0 steps lost
    assert after["weights"] == c.records("B", "exit")[0]["weights"]  # bitwise: the snapshot
    assert snapshot in [ck.step for ck in complete_local_checkpoints(str(tmp_path / "local-A"))]
    assert snapshot in committed(c.dirpath)  # drained to the bucket from the survivor
    assert "replicated step" in c.log("B") or "replicated step" in c.log("A")


@pytest.mark.slow
def test_three_nodes_two_tier_node_loss_with_the_peer_replica_loses_no_step(
    cluster_factory: type[Cluster], tmp_path: Path
) -> None:
    """3 -> 2 nodes: no survivor's disk holds the whole snapshot, the two together do; they
    upload it to the bucket before choosing what to resume (replica.complete_from_peers)."""
    import shutil

    from throttled_fs import set_rate

    slow = tmp_path / "slow"
    args = ("--max-steps", "25", "--every", "10", "--grace", "6", "--replica")
    c = cluster_factory(nnodes="2:3", url_prefix="slow://", script_args=args)
    env = {"LP_SLOW_DIR": str(slow)}
    for name in ("A", "B", "C"):
        c.start(name, env=env, extra=("--local-dirpath", str(tmp_path / f"local-{name}")))
    began = c.wait_world("ABC", 3)
    c.wait_step("C", max(12, began + 2))
    set_rate(slow, 5_000)  # no rank's share can be uploaded within the grace period
    c.preempt("C")
    assert c.wait("C") == 143, c.log("C")
    shutil.rmtree(tmp_path / "local-C")
    set_rate(slow, 0)
    assert c.wait("A") == 0 and c.wait("B") == 0, c.log("A")

    (c_exit,) = c.records("C", "exit")
    snapshot = c_exit["step"]
    for name in ("A", "B"):
        starts = c.records(name, "start")
        after = starts[-1]
        assert 3 in [r["world_size"] for r in starts[:-1]] and after["world_size"] == 2
        assert after["start_step"] == snapshot  # 0 steps lost
        assert after["weights"] == c_exit["weights"]  # bitwise
    assert snapshot in committed(c.dirpath)  # completed in the bucket by the survivors


@pytest.mark.slow
def test_unannounced_node_loss_resumes_from_the_last_periodic_checkpoint(cluster_factory: type[Cluster]) -> None:
    """A node that vanishes without SIGTERM (SIGKILL to its agent and worker): the survivor's
    collective fails (connection reset), torchrun restarts it at N-1, and it resumes from the
    newest periodic checkpoint (the steps since are lost, as with any hard failure)."""
    from lightning_preempt import ShardedAsyncCheckpointIO

    c = cluster_factory(nnodes="1:2", script_args=("--max-steps", "25", "--every", "10"))
    c.start("A")
    c.start("B")
    c.wait_step("B", 15)
    c.kill_node("B")
    assert c.wait("A") == 0, c.log("A")
    after = c.records("A", "start")[-1]
    assert after["world_size"] == 1 and after["restart_count"] == 1
    assert after["start_step"] in (10, 20)  # a periodic save (keep_last_n=3 keeps both)
    ckpt = ShardedAsyncCheckpointIO().load_checkpoint(str(c.dirpath / f"step-{after['start_step']:010d}"))
    assert after["weights"] == state_sha(ckpt["state_dict"])  # bitwise: that checkpoint
    assert c.records("A", "exit")[-1]["step"] == 25


# ---- data at a resize (issue 22) ------------------------------------------------------------------
def epoch_passes(c: Cluster, names: tuple[str, ...], n: int) -> dict[str, dict[int, tuple[list[int], list[int], int]]]:
    """Per loader, per epoch: (indices never trained, indices trained more than once, samples trained)."""
    import json
    from collections import Counter

    seen: dict[str, dict[int, Counter[int]]] = {}
    for name in names:
        for path in c.status.glob(f"{name}.*.samples.jsonl"):
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                for loader, idx in rec["idx"].items():
                    seen.setdefault(loader, {}).setdefault(rec["epoch"], Counter()).update(idx)
    return {
        loader: {
            epoch: (sorted(set(range(n)) - set(cnt)), sorted(i for i, k in cnt.items() if k > 1), sum(cnt.values()))
            for epoch, cnt in epochs.items()
        }
        for loader, epochs in seen.items()
    }


@pytest.mark.slow
def test_elastic_resizes_train_every_sample_of_an_epoch_once(cluster_factory: type[Cluster]) -> None:
    """A node leaves mid-epoch (2 -> 1) and comes back mid-epoch (1 -> 2): every sample of
    the epoch is trained once over the three worlds, for the sampler Lightning injects and for
    StatefulDataLoader(shuffle=True) (Lightning's DistributedSamplerWrapper), each with and
    without a worker process: four training loaders in one run (elastic_script.LOADERS)."""
    n = 960  # batches of 8: 60 per rank and epoch at world 2, 120 at world 1
    args = ("--loaders", str(n), "--max-steps", "100", "--step-sleep", "0.2", "--global-batch", "keep")
    c = cluster_factory(nnodes="1:2", script_args=args)
    c.start("A")
    c.start("B")
    c.wait_step("B", 5)
    c.preempt("B")
    assert c.wait("B") == 143, c.log("B")
    leave = c.wait_starts("A", 2)[1]
    c.wait_step("A", leave["start_step"] + 3)
    c.start("B")  # the node is back
    assert c.wait("A") == 0, c.log("A")
    assert c.wait("B") == 0, c.log("B")

    starts = sorted([*c.records("A", "start"), *c.records("B", "start")], key=lambda r: r["time"])
    worlds = [s["world_size"] for s in starts]
    assert worlds == [2, 2, 1, 2, 2], worlds
    resumes = [s for s in starts if s["start_step"] > 0]
    assert len(resumes) == 3, starts  # A at 1, then A and B at 2
    for s in resumes:  # both resizes land inside epoch 0
        assert s["epoch"] == 0 and s["batch_in_epoch"] > 0, resumes
    passes = epoch_passes(c, ("A", "B"), n)
    assert set(passes) == {"dataloader", "dataloader-workers", "stateful", "stateful-workers"}
    for loader, epochs in passes.items():
        missing, twice, trained = epochs[0]
        assert not missing and not twice and trained == n, (
            f"{loader}, epoch 0: {len(missing)} samples missing, {len(twice)} twice, {trained} trained of {n}"
        )
        if 1 in epochs:  # the epoch after: the samplers' own split again, nothing twice so far
            assert not epochs[1][1], (loader, epochs[1][1])
    # global_batch="keep": 2 ranks x 1 -> 1 rank x 2 accumulated -> 2 ranks x 1
    a_log = (c.tmp / "A.agent.log").read_text(errors="replace")
    assert "accumulate_grad_batches 1 -> 2" in a_log and "accumulate_grad_batches 2 -> 1" in a_log
