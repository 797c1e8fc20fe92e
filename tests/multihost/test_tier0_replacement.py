"""Tier 0 across two real nodes (network namespaces, one torchrun agent each, each node with
its own tier-0 memory: tests/support/netns_job.py ``memory=``): node 1 is lost after a tier-0
copy newer than the newest disk checkpoint committed and went to node 0, node 1 comes back
as a *replacement* (its memory empty), and the restart resumes from tier 0, not the disk,
to the weights of a run never interrupted (docs/tier0.md, "Several hosts").

Needs root and iproute2; elsewhere it skips with one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ckpts import committed
from netns import Hosts
from netns_job import NodeJob

ROOT = Path(__file__).resolve().parents[2]
KILL_AT = 12  # tier 0 copies every 2 steps, the disk every 5: disk holds 10, tier 0 holds 12
ARGS = ["--max-steps", "30", "--step-sleep", "0.1"]

pytestmark = [pytest.mark.multihost, pytest.mark.multiproc, pytest.mark.timeout(900)]


def _args(memory: Path, disk: int | None, *more: str) -> list[str]:
    kwargs = {"tier0_every_n_steps": 2, "tuning": {"memory_dirpath": str(memory / "tier0")}}
    return [*ARGS, *(["--every", str(disk)] if disk else []), "--cb-kwargs", json.dumps(kwargs), *more]


def _steps(node_memory: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in node_memory.glob("step-*/manifest.json"))


def _ranks_held(step_dir: Path) -> set[int]:
    """The ranks whose shard a node's copy holds (DCP's ``__<rank>_<n>.distcp``)."""
    return {int(p.name.split("_")[2]) for p in step_dir.glob("__*_*.distcp")}


@pytest.mark.slow
@pytest.mark.parametrize(("lost", "disk"), [(1, 5), (0, 5), (1, None)])
def test_replacement_node_resumes_from_its_peers_memory(
    hosts: Hosts, memory: Path, tmp_path: Path, lost: int, disk: int | None
) -> None:
    """Node ``lost`` (0: rank 0's node, the rendezvous host) is replaced; the other sends it
    the copy, and rank 0 resumes from tier 0 either way. ``disk=None``: no periodic disk
    save at all (Lightning's peek sees nothing; the engine looks again after the restore)."""
    _replace(hosts, memory, tmp_path, lost, disk, 2)


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [3], indirect=True)
def test_a_ring_of_three_nodes_gives_a_replacement_its_share_from_the_peer(
    hosts: Hosts, memory: Path, tmp_path: Path
) -> None:
    """Three nodes: each holds its own share and its predecessor's (the ring), so node 1's
    share survives only on node 2. Node 1 is lost and replaced empty; the restore completes
    the copy from the survivors and the run resumes from tier 0, bit-identical."""
    _replace(hosts, memory, tmp_path, 1, 5, 3)


def _replace(hosts: Hosts, memory: Path, tmp_path: Path, lost: int, disk: int | None, n: int) -> None:
    nodes = list(range(n))
    ref = NodeJob(hosts, tmp_path / "reference", nodes, _args(memory / "ref", disk), memory=memory / "ref")
    assert ref.wait(300) == dict.fromkeys(nodes, 0), ref.log(0)
    reference = ref.result(0)
    assert reference is not None and reference["step"] == 30

    # Node ``lost``'s worker dies by SIGKILL once its copy of step 12 and the peer copy
    # committed (saved-kill waits for every queued job), then every process of that node goes.
    job = NodeJob(hosts, tmp_path / "run", nodes, _args(memory, disk, "--signal-at", f"saved-kill:{KILL_AT}",
                                                        "--signal-rank", str(lost)), memory=memory)  # fmt: skip
    job.wait_step(KILL_AT - 4)
    assert job.wait_gone([lost], timeout=240) is not None, job.log(lost)
    hosts.kill_node(lost)
    others = [i for i in nodes if i != lost]
    assert job.wait_gone(others, timeout=60) is not None, job.log(others[0])
    job.wait(60)
    assert sorted(committed(job.dirpath)) == ([5, 10] if disk else []), committed(job.dirpath)
    # The peer copies landed; each node keeps the newest copy: its own share and its predecessor's.
    for i in nodes:
        assert _steps(memory / f"node{i}") == [KILL_AT], (i, _steps(memory / f"node{i}"))
        assert _ranks_held(memory / f"node{i}" / f"step-{KILL_AT:010d}") == {i, (i - 1) % n}, i
    shutil.rmtree(memory / f"node{lost}")  # a replacement node: empty memory

    again = NodeJob(hosts, tmp_path / "run", nodes, _args(memory, disk), memory=memory)
    assert again.wait(300) == dict.fromkeys(nodes, 0), "\n".join(again.log(i) for i in nodes)
    result = again.result(0)
    assert result is not None and result["start_step"] == KILL_AT and result["step"] == 30, result
    assert str(result["resumed_from"]).startswith(str(memory / "tier0")), result
    logs = "".join((again.status / f"node{i}.log").read_text(errors="replace") for i in nodes)
    # Two nodes: only the replacement lacks files. Three: every node lacks some share.
    assert f"tier 0's step {KILL_AT} completed on {1 if n == 2 else n} node(s) from their peers" in logs
    done = subprocess.run([sys.executable, "-m", "lightning_preempt.cli", "report", str(job.dirpath), "--json"],
                          capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)  # fmt: skip
    [loss] = json.loads(done.stdout)["preemptions"]
    assert loss["resumed_step"] == KILL_AT and loss["resumed_tier"] == "memory", loss
    assert max(_steps(memory / f"node{lost}")) > KILL_AT  # the replacement node copies again
    # Bit-identical to the run never interrupted; at 3 nodes only since the resumed DDP starts
    # in the saved bucket layout (docs/exact-resume.md, "DDP's gradient buckets").
    assert result["weights"] == reference["weights"]
