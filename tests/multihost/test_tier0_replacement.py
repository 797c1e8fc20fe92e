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
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpts import committed
from netns import Hosts
from netns_job import NodeJob

ROOT = Path(__file__).resolve().parents[2]
KILL_AT = 12  # tier 0 copies every 2 steps, the disk every 5: disk holds 10, tier 0 holds 12
ARGS = ["--max-steps", "30", "--step-sleep", "0.1"]

pytestmark = [pytest.mark.multihost, pytest.mark.multiproc, pytest.mark.timeout(900)]


@pytest.fixture
def memory() -> Iterator[Path]:
    """The nodes' tier-0 memories, in the machine's tmpfs (removed afterwards)."""
    path = Path("/dev/shm") / f"lp-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _args(memory: Path, disk: int | None, *more: str) -> list[str]:
    kwargs = {"tier0_every_n_steps": 2, "memory_dirpath": str(memory / "tier0")}
    return [*ARGS, *(["--every", str(disk)] if disk else []), "--cb-kwargs", json.dumps(kwargs), *more]


def _steps(node_memory: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in node_memory.glob("step-*/manifest.json"))


@pytest.mark.slow
@pytest.mark.parametrize(("lost", "disk"), [(1, 5), (0, 5), (1, None)])
def test_replacement_node_resumes_from_its_peers_memory(
    hosts: Hosts, memory: Path, tmp_path: Path, lost: int, disk: int | None
) -> None:
    """Node ``lost`` (0: rank 0's node, the rendezvous host) is replaced; the other sends it
    the copy, and rank 0 resumes from tier 0 either way. ``disk=None``: no periodic disk
    save at all (Lightning's peek sees nothing; the engine looks again after the restore)."""
    ref = NodeJob(hosts, tmp_path / "reference", [0, 1], _args(memory / "ref", disk), memory=memory / "ref")
    assert ref.wait(300) == {0: 0, 1: 0}, ref.log(0)
    reference = ref.result(0)
    assert reference is not None and reference["step"] == 30

    # Node ``lost``'s worker dies by SIGKILL once its copy of step 12 and the peer copy
    # committed (saved-kill waits for every queued job), then every process of that node goes.
    job = NodeJob(hosts, tmp_path / "run", [0, 1], _args(memory, disk, "--signal-at", f"saved-kill:{KILL_AT}",
                                                         "--signal-rank", str(lost)), memory=memory)  # fmt: skip
    job.wait_step(KILL_AT - 4)
    assert job.wait_gone([lost], timeout=240) is not None, job.log(lost)
    hosts.kill_node(lost)
    assert job.wait_gone([1 - lost], timeout=60) is not None, job.log(1 - lost)
    job.wait(60)
    assert sorted(committed(job.dirpath)) == ([5, 10] if disk else []), committed(job.dirpath)
    # The peer copy landed; each node keeps the newest copy (own share and its peer's).
    assert _steps(memory / "node0") == _steps(memory / "node1") == [KILL_AT]
    assert {p.name for p in (memory / "node0" / f"step-{KILL_AT:010d}").iterdir()} == {
        p.name for p in (memory / "node1" / f"step-{KILL_AT:010d}").iterdir()
    }
    shutil.rmtree(memory / f"node{lost}")  # a replacement node: empty memory

    again = NodeJob(hosts, tmp_path / "run", [0, 1], _args(memory, disk), memory=memory)
    assert again.wait(300) == {0: 0, 1: 0}, again.log(0) + "\n" + again.log(1)
    result = again.result(0)
    assert result is not None and result["start_step"] == KILL_AT and result["step"] == 30, result
    assert str(result["resumed_from"]).startswith(str(memory / "tier0")), result
    assert result["weights"] == reference["weights"]  # bit-identical to the run never interrupted
    logs = "".join((again.status / f"node{n}.log").read_text(errors="replace") for n in (0, 1))
    assert f"tier 0's step {KILL_AT} completed on 1 node(s) from their peers" in logs
    done = subprocess.run([sys.executable, "-m", "lightning_preempt.cli", "report", str(job.dirpath), "--json"],
                          capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)  # fmt: skip
    [loss] = json.loads(done.stdout)["preemptions"]
    assert loss["resumed_step"] == KILL_AT and loss["resumed_tier"] == "memory", loss
    assert max(_steps(memory / f"node{lost}")) > KILL_AT  # the replacement node copies again
