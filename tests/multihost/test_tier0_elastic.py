"""Tier 0 at N-1: two real nodes (network namespaces, one torchrun agent each, each node with
its own tier-0 memory), node 1 is lost without a signal after a tier-0 copy newer than the
newest disk checkpoint, and the job restarts on node 0 alone. Node 0's memory holds its own
share and node 1's (the peer copy), so the run resumes at world size 1 from memory, not from
the older disk checkpoint, and trains every sample of the interrupted epoch exactly once
(docs/tier0.md, "Several hosts"; docs/elastic.md).

Needs root and iproute2; elsewhere it skips with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from ckpts import committed
from netns import Hosts
from netns_job import NodeJob

ROOT = Path(__file__).resolve().parents[2]
KILL_AT = 12  # tier 0 copies every 2 steps, the disk every 5: disk holds 10, tier 0 holds 12
N = 512  # samples; batches of 16: 16 steps an epoch at 2 ranks, 32 at 1

pytestmark = [pytest.mark.multihost, pytest.mark.multiproc, pytest.mark.timeout(900)]


def _args(memory: Path, *more: str) -> list[str]:
    kwargs = {"tier0_every_n_steps": 2, "tuning": {"memory_dirpath": str(memory / "tier0")}}
    return ["--max-steps", "30", "--step-sleep", "0.1", "--every", "5", "--samples", "--data-size", str(N),
            "--cb-kwargs", json.dumps(kwargs), *more]  # fmt: skip


def _samples(job: NodeJob) -> list[dict[str, Any]]:
    return [json.loads(line) for p in job.status.glob("rank*.samples.jsonl") for line in p.read_text().splitlines()]


@pytest.mark.slow
def test_a_node_lost_for_good_resumes_at_n_minus_1_from_its_peers_memory_sample_exact(
    hosts: Hosts, memory: Path, tmp_path: Path
) -> None:
    job = NodeJob(hosts, tmp_path, [0, 1], _args(memory, "--signal-at", f"saved-kill:{KILL_AT}", "--signal-rank", "1"),
                  memory=memory)  # fmt: skip
    job.wait_step(KILL_AT - 4)
    assert job.wait_gone([1], timeout=240) is not None, job.log(1)
    hosts.kill_node(1)  # the node is gone for good, its memory with it
    assert job.wait_gone([0], timeout=60) is not None, job.log(0)
    job.wait(60)
    assert sorted(committed(job.dirpath)) == [5, 10], committed(job.dirpath)
    # The peer copy landed: node 0's memory holds both ranks' shares of step 12.
    copy = memory / "node0" / f"step-{KILL_AT:010d}"
    held = {p.name.split("_")[2] for p in copy.glob("__*_*.distcp")}  # DCP's __<rank>_<n>.distcp
    assert (copy / "manifest.json").is_file() and held == {"0", "1"}, held

    alone = NodeJob(hosts, tmp_path, [0], _args(memory), memory=memory)
    assert alone.wait(300) == {0: 0}, alone.log(0)
    result = alone.result(0)
    assert result is not None and result["start_step"] == KILL_AT and result["step"] == 30, result
    assert str(result["resumed_from"]).startswith(str(memory / "tier0")), result  # memory, not the disk's 10
    done = subprocess.run([sys.executable, "-m", "lightning_preempt.cli", "report", str(job.dirpath), "--json"],
                          capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)  # fmt: skip
    [loss] = json.loads(done.stdout)["preemptions"]
    assert loss["kind"] == "node lost" and loss["resumed_step"] == KILL_AT and loss["resumed_tier"] == "memory", loss

    # Sample-exact: the first launch's batches up to the resumed step (what the copy holds;
    # the steps after it died with the node), then the world of 1: every sample of epoch 0 once.
    first = [r for r in _samples(job) if int(r["step"]) < KILL_AT]
    second = _samples(alone)
    assert {r["world"] for r in first} == {2} and {r["world"] for r in second} == {1}
    assert min(int(r["step"]) for r in second) == KILL_AT
    seen = Counter(i for r in [*first, *second] if r["epoch"] == 0 for i in r["idx"])
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, (
        f"epoch 0: {N - len(seen)} samples missing, {sum(1 for c in seen.values() if c > 1)} twice"
    )
