"""Heartbeats against a local sender of UDP (issue 55; collective/heartbeat.py, docs/security.md):
a bounded junk flood at a rank whose Python holds the interpreter lock does not make it declare a
live peer lost, and captured datagrams replayed from a SIGKILLed rank's own address do not keep
it alive. Real processes (tests/support/heartbeat_script.py), 127.0.0.1 only; Linux (the kernel filter)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_preempt.collective.heartbeat import Heartbeat, packet
from lightning_preempt.collective.udp_filter import admit_only, program

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "heartbeat_script.py"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel filter is Linux's")
TIMEOUT_S = 1.0  # the mesh's loss timeout (HB_TIMEOUT)


def _start(tmp: Path, rank: int, world: int, held: str, **env: str) -> subprocess.Popen[bytes]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "HB_TIMEOUT": str(TIMEOUT_S), **env}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(tmp), str(rank), str(world), held], env=full)


def _started(tmp: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60
    while not all((tmp / f"started{r}").exists() for r in range(len(procs))):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the mesh did not start"
        time.sleep(0.02)


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _flood(addr: tuple[str, int], count: int, rate: float, until: threading.Event) -> int:
    """Send at most ``count`` junk datagrams at ``rate`` per second to ``addr`` (127.0.0.1): random
    bytes, and rank 1's heartbeat with a forged MAC and a sequence number far ahead."""
    forged = b"\0" * 32 + json.dumps({"r": 1, "i": "x", "n": 10**12, "h": [3]}).encode()
    junk = [os.urandom(1000 + 6 * i) for i in range(64)] + [forged]  # large: each costs a full HMAC
    sent, start = 0, time.monotonic()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        while sent < count and not until.is_set():
            for i in range(100):
                try:
                    s.sendto(junk[(sent + i) % len(junk)], addr)
                except OSError:  # (ECONNREFUSED from an earlier datagram's ICMP: the rank is gone)
                    return sent
            sent += 100
            ahead = sent / rate - (time.monotonic() - start)
            if ahead > 0:  # pace the flood (not a synchronisation)
                time.sleep(ahead)
    return sent


def test_a_junk_flood_does_not_make_a_busy_rank_lose_its_peer(tmp_path: Path) -> None:
    """Up to 80k junk datagrams/s (480k in all) at rank 0, whose threads run Python without pause
    (before issue 55 both ranks declared the other lost): no rank reaches a verdict, and
    both leave cleanly after it."""
    timeout = str(2 * TIMEOUT_S)  # (a rank starved of CPU on a crowded machine is not the flood's doing)
    procs = [
        _start(tmp_path, 0, 2, "3", HB_BUSY="1", HB_TIMEOUT=timeout),
        _start(tmp_path, 1, 2, "3", HB_TIMEOUT=timeout),
    ]
    try:
        _started(tmp_path, procs)
        addr = json.loads((tmp_path / "addr0.json").read_text())
        began = time.monotonic()
        sent = _flood((addr[0], addr[1]), count=480_000, rate=80_000, until=threading.Event())
        rate = sent / (time.monotonic() - began)
        assert sent == 480_000 and rate > 20_000, f"{sent} datagrams sent, {rate:.0f}/s: not a flood"
        time.sleep(2 * float(timeout))  # a verdict the flood caused would be reached by now
        verdicts = [r for r in (0, 1) if (tmp_path / f"verdict{r}.json").exists()]
        detail = [json.loads((tmp_path / f"verdict{r}.json").read_text()) for r in verdicts]
        assert verdicts == [] and all(p.poll() is None for p in procs), f"the flood made ranks decide: {detail}"
        for r in (0, 1):
            (tmp_path / f"bye{r}").touch()
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    finally:
        _end(procs)


def test_a_replayed_datagram_does_not_keep_a_killed_rank_alive(tmp_path: Path) -> None:
    """After rank 1 is SIGKILLed, its port is bound by another process that replays rank 1's
    first 16 datagrams (what an observer captured: the same bytes, its key, its incarnation,
    its address) to rank 0, over and over at the heartbeat rate: rank 0 still finds rank 1
    lost while the replay goes on."""
    procs = [_start(tmp_path, 0, 2, "3"), _start(tmp_path, 1, 2, "3")]
    try:
        _started(tmp_path, procs)
        a0, a1 = (json.loads((tmp_path / f"addr{r}.json").read_text()) for r in (0, 1))
        old = [packet(b"k" * 32, {"r": 1, "i": a1[2], "n": n, "h": [3]}) for n in range(1, 17)]
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=30)
        replays, limit = 0, int(30 * 8 * len(old))  # 30 s of replay at most
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((a1[0], a1[1]))  # the dead rank's address: the kernel filter lets it through
            while procs[0].poll() is None and replays < limit:
                s.sendto(old[replays % len(old)], (a0[0], a0[1]))
                replays += 1
                time.sleep(TIMEOUT_S / 8 / len(old))  # all of them every heartbeat interval
        assert procs[0].wait(timeout=30) == 75, "rank 0 did not find the killed rank lost"
        assert replays < limit, "the replay kept the killed rank alive for 30 s"
    finally:
        _end(procs)
    verdict = json.loads((tmp_path / "verdict0.json").read_text())
    assert verdict["lost"] == [1] and verdict["survivors"] == [0]


def test_the_kernel_filter_queues_only_the_peers_datagrams() -> None:
    with contextlib.ExitStack() as stack:
        rank, peer, other = (stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) for _ in range(3))
        for s in (rank, peer, other):
            s.bind(("127.0.0.1", 0))
        assert admit_only(rank, [("10.1.2.3", 4), peer.getsockname()])
        for s, data in ((other, b"junk"), (peer, b"real"), (other, b"junk"), (peer, b"end")):
            s.sendto(data, rank.getsockname())
        rank.settimeout(30)
        assert [rank.recv(64), rank.recv(64)] == [b"real", b"end"]  # the junk was never queued
    assert program([("0.0.0.0", 5)]) is None and program([("::1", 5)]) is None  # not told by address


def test_junk_replays_and_strangers_are_dropped_and_only_fresh_datagrams_taken() -> None:
    """In process, from the peer's own address (so the kernel filter lets everything through):
    junk, a datagram of another incarnation, a fresh one, its replay, then a newer one. Only
    the two fresh ones are taken; each other kind is counted where it was dropped."""
    got: list[object] = []
    hb = Heartbeat(0, 2, key=b"k" * 32, held=lambda: [1], on_verdict=got.append, interval_s=5.0, timeout_s=60.0,
                   settle_s=1.0, host="127.0.0.1")  # fmt: skip
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
        peer.bind(("127.0.0.1", 0))
        hb.start({1: peer.getsockname()}, {1: "one"})
        try:
            key = b"k" * 32
            sends = [os.urandom(60) for _ in range(40)] + [
                packet(key, {"r": 1, "i": "another", "n": 50, "h": [9]}),  # another incarnation
                packet(key, {"r": 1, "i": "one", "n": 5, "h": [5]}),  # fresh
                packet(key, {"r": 1, "i": "one", "n": 5, "h": [6]}),  # its sequence number again
                packet(key, {"r": 1, "i": "one", "n": 4, "h": [6]}),  # older
                packet(key, {"r": 7, "i": "one", "n": 9, "h": [6]}),  # no such peer
                packet(key, {"r": 1, "i": "one", "n": 6, "h": [7]}),  # fresh
            ]
            for data in sends:
                peer.sendto(data, hb.address)
            deadline = time.monotonic() + 30
            while sum(hb.dropped.values()) < 44 or hb._held_by.get(1) != (7,):
                assert time.monotonic() < deadline, (hb.dropped, hb._held_by)
                time.sleep(0.01)
            assert hb.dropped == {"junk": 40, "foreign": 2, "stale": 2} and hb._seen == {1: 6}
            assert got == [] and hb.filtered
        finally:
            hb.stop(bye=False)
