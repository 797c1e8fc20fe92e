"""The heartbeat mesh (collective/heartbeat.py) between real processes on 127.0.0.1: a SIGKILLed
rank is found by every survivor, which agree on the survivors and the newest common step; a
rank that leaves cleanly is not taken for lost; packets without the run's key are dropped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lightning_preempt.collective.heartbeat import agreed_step, has_quorum

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "heartbeat_script.py"
ROOT = Path(__file__).resolve().parents[2]


def _mesh(tmp: Path, held: list[str], timeout: float = 1.0) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HB_TIMEOUT": str(timeout)}
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(tmp), str(r), str(len(held)), h], env=env)
             for r, h in enumerate(held)]  # fmt: skip
    deadline = time.monotonic() + 60
    while not all((tmp / f"started{r}").exists() for r in range(len(held))):
        assert time.monotonic() < deadline, "the mesh did not start"
        time.sleep(0.02)
    return procs


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_quorum_and_common_step() -> None:
    assert has_quorum([0, 1], 3) and not has_quorum([2], 3)
    assert has_quorum([0], 2) and not has_quorum([1], 2)  # a tie goes to rank 0's side
    assert agreed_step({0: [5, 10], 1: [5, 10, 15]}, [0, 1]) == 10
    assert agreed_step({0: [5], 1: [10]}, [0, 1]) is None


def test_sigkilled_rank_is_found_and_survivors_agree(tmp_path: Path) -> None:
    procs = _mesh(tmp_path, ["10,20", "10,20,30", "10,20"])
    try:
        time.sleep(0.5)
        killed = time.monotonic()
        procs[2].send_signal(signal.SIGKILL)
        codes = [procs[r].wait(timeout=30) for r in (0, 1)]
        took = time.monotonic() - killed
    finally:
        _end(procs)
    assert codes == [75, 75]
    verdicts = [json.loads((tmp_path / f"verdict{r}.json").read_text()) for r in (0, 1)]
    for v in verdicts:
        assert v["survivors"] == [0, 1] and v["lost"] == [2]
        assert v["agreed_step"] == 20 and v["quorum"] and v["agreed"]
        assert v["silent_s"] >= 1.0
    assert took < 10.0, f"survivors exited {took:.1f} s after the kill"
    assert not (tmp_path / "verdict2.json").exists()


def test_clean_leave_is_not_a_loss(tmp_path: Path) -> None:
    procs = _mesh(tmp_path, ["1", "1"])
    try:
        (tmp_path / "bye1").touch()
        assert procs[1].wait(timeout=30) == 0
        time.sleep(2.5)  # more than twice the timeout
        assert procs[0].poll() is None, "rank 0 took a clean leave for a loss"
        assert not (tmp_path / "verdict0.json").exists()
    finally:
        (tmp_path / "bye0").touch()
        procs[0].wait(timeout=30)
        _end(procs)


def test_foreign_packets_do_not_keep_a_lost_rank_alive(tmp_path: Path) -> None:
    procs = _mesh(tmp_path, ["3", "3"])
    addr = json.loads((tmp_path / "addr0.json").read_text())
    try:
        procs[1].send_signal(signal.SIGKILL)
        # someone sends rank 1's heartbeats without the key: rank 0 must still find it lost
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(40):
                s.sendto(b"x" * 32 + json.dumps({"r": 1, "n": 1, "h": [3]}).encode(), (addr[0], addr[1]))
                time.sleep(0.05)
        assert procs[0].wait(timeout=30) == 75
    finally:
        _end(procs)
    v = json.loads((tmp_path / "verdict0.json").read_text())
    assert v["lost"] == [1] and v["quorum"]  # alone but with rank 0: half, with rank 0
