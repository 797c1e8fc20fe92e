"""Heartbeats between the ranks of one job on a side channel (docs/failure-detection.md).

A rank lost without a signal would leave the others in their next collective until its
timeout (10-30 min with NCCL). Each rank sends a small UDP datagram (never blocks, no
connection) to every other every ``interval_s``; a peer silent for ``timeout_s`` is lost, and
the ranks then exchange views until they agree on a :class:`Verdict` (survivors, newest step
all hold, quorum). Datagrams: JSON, at most :data:`MAX_DATAGRAM` bytes, HMAC under a per-run key;
a kernel filter queues only the peers' (collective/udp_filter.py); one counts only when its
sender's sequence number is newer than the last one taken from that rank (a replay keeps
nobody alive); each wake-up drains up to :data:`DRAIN_MAX` of them, junk dropped after one
HMAC (a flood costs work, never a verdict; docs/security.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_preempt.collective.udp_filter import admit_only

log = logging.getLogger(__name__)

#: The largest datagram read (a heartbeat of 1024 ranks' views stays well under it).
MAX_DATAGRAM = 16 << 10
#: Steps a rank reports as held, at most (the newest ones).
MAX_HELD = 8
#: Datagrams read per wake-up, at most: a flood is drained in batches (the kernel's buffer does
#: not fill and drop the real ones) and still cannot keep the thread from its sends and checks.
DRAIN_MAX = 512
#: The receive buffer asked for (the kernel caps it at ``net.core.rmem_max``): room for a
#: flood's datagrams between two wake-ups.
RCVBUF = 4 << 20
_MAC = 32


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a rank concluded after a loss (the same on every survivor when ``agreed``)."""

    rank: int  # the rank that reached it
    world: int
    survivors: tuple[int, ...]
    lost: tuple[int, ...]
    agreed_step: int | None  # the newest step every survivor holds (None: no common step)
    quorum: bool  # the survivors are more than half the world (or half with rank 0)
    agreed: bool  # every survivor reported the same survivors before the settle window ended
    silent_s: float  # how long the lost ranks had been silent when the verdict was reached
    detected_t: float  # time.monotonic() when the loss was first seen
    decided_t: float  # time.monotonic() of the verdict

    @property
    def writer(self) -> int:
        """The survivor that records the verdict: the lowest surviving rank."""
        return min(self.survivors)


def has_quorum(survivors: Sequence[int], world: int) -> bool:
    """More than half of ``world``, or exactly half including rank 0 (a tie goes to rank 0's side)."""
    n = len(set(survivors))
    return 2 * n > world or (2 * n == world and 0 in survivors)


def agreed_step(held: Mapping[int, Sequence[int]], survivors: Sequence[int]) -> int | None:
    """The newest step every survivor holds: the largest in the intersection of their lists."""
    sets = [set(held.get(r, ())) for r in survivors]
    return max(set.intersection(*sets), default=None) if sets else None


def route_source(host: str, family: int = socket.AF_UNSPEC) -> str | None:
    """The local address the peers at ``host`` reach this one on: the source address of the
    route there (``host``'s own if a loopback address); ``None`` if it resolves to no route."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, family, socket.SOCK_DGRAM)[0]
        if ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback:
            return str(sockaddr[0])
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # routing only: a UDP connect sends nothing
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return None


def packet(key: bytes, msg: Mapping[str, Any]) -> bytes:
    """A datagram: the HMAC-SHA256 of the JSON body under ``key``, then the body."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    return hmac.digest(key, body, hashlib.sha256) + body


class Heartbeat:
    """One rank's heartbeat thread (see the module docstring).

    Args:
        rank, world: this rank and the world size.
        key: the run's shared HMAC key (the same bytes on every rank).
        held: returns the steps this rank holds (newest committed ones; called on the thread).
        on_verdict: called once, on the heartbeat thread, with the :class:`Verdict` after a loss.
        interval_s: time between two heartbeats to every peer.
        timeout_s: a peer silent this long is lost.
        settle_s: at most this long after the loss the survivors exchange views before deciding.
        host: the address to bind (the interface the other ranks reach this one on).
    """

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        key: bytes,
        held: Callable[[], Sequence[int]],
        on_verdict: Callable[[Verdict], None],
        interval_s: float = 0.5,
        timeout_s: float = 4.0,
        settle_s: float = 2.0,
        host: str = "0.0.0.0",
    ) -> None:
        self.rank, self.world, self._key = rank, world, key
        self._held, self._on_verdict = held, on_verdict
        self.interval_s, self.timeout_s, self.settle_s = interval_s, timeout_s, settle_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self._sock.bind((host, 0))
        self._sock.setblocking(False)
        self._selector = selectors.DefaultSelector()  # (epoll: no limit on the fd's number, unlike select)
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._wake_s = min(0.1, interval_s / 2)
        self.address: tuple[str, int] = self._sock.getsockname()
        #: this Heartbeat's random identity: a datagram names its sender's, and a receiver
        #: takes a rank's datagrams from one incarnation only (a restarted rank is another)
        self.incarnation = os.urandom(8).hex()
        self._peers: dict[int, tuple[str, int]] = {}
        self._incarnations: dict[int, str] = {}
        self._seen: dict[int, int] = {}  # rank -> the newest sequence number taken from it
        #: datagrams dropped: ``junk`` (size, HMAC), ``foreign`` (no peer, another incarnation,
        #: not our message), ``stale`` (a sequence number not newer: a replay, a late one)
        self.dropped = {"junk": 0, "foreign": 0, "stale": 0}
        self.filtered = False  # the kernel filter is on (set by start)
        self._last: dict[int, float] = {}  # rank -> monotonic time last heard
        self._views: dict[int, tuple[int, ...]] = {}  # rank -> the survivors it reported (after a loss)
        self._held_by: dict[int, tuple[int, ...]] = {}
        self._gone: set[int] = set()  # ranks that said bye
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_preempt-heartbeat", daemon=True)
        self._detected: float | None = None
        self.verdict: Verdict | None = None
        self._decided = threading.Event()
        self._seq = 0
        self._seq_lock = threading.Lock()

    def start(self, peers: dict[int, tuple[str, int]], incarnations: Mapping[int, str] | None = None) -> None:
        """Start heartbeating to ``peers`` (rank -> address, this rank's own entry ignored);
        ``incarnations``: each peer's :attr:`incarnation` (exchanged with the addresses; without
        it, the first incarnation a rank's authentic datagram names is the one taken)."""
        self._peers = {int(r): (str(a[0]), int(a[1])) for r, a in peers.items() if int(r) != self.rank}
        self._incarnations = {int(r): str(i) for r, i in (incarnations or {}).items() if int(r) in self._peers}
        self.filtered = admit_only(self._sock, self._peers.values())
        if not self.filtered:
            log.debug("lightning_preempt: heartbeat: no kernel filter on its socket; junk is dropped after its HMAC")
        self._last = dict.fromkeys(self._peers, time.monotonic())  # a peer never heard is lost after timeout_s
        self._thread.start()

    def stop(self, *, bye: bool = True) -> None:
        """Stop the thread; with ``bye`` tell the peers this rank leaves cleanly (not lost)."""
        if bye and self._peers and self.verdict is None:
            for _ in range(3):  # datagrams may be dropped: three tries cost nothing
                self._send({"bye": True})
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        self._sock.close()
        self._selector.close()

    def wait_verdict(self, timeout_s: float) -> Verdict | None:
        """The verdict, once reached (``None`` after ``timeout_s`` without a loss)."""
        self._decided.wait(max(0.0, timeout_s))
        return self.verdict

    @property
    def watching(self) -> bool:
        """Some peer is still watched (not every other rank left cleanly)."""
        return any(r not in self._gone for r in self._peers)

    def _send(self, extra: dict[str, Any]) -> None:
        with self._seq_lock:  # (stop() sends its bye from another thread)
            self._seq += 1
            seq = self._seq
        data = packet(self._key, {"r": self.rank, "i": self.incarnation, "n": seq, **extra})
        for r, addr in self._peers.items():
            if r in self._gone:
                continue
            with contextlib.suppress(OSError):  # no route (a link down): the peer simply stays silent
                self._sock.sendto(data, addr)

    def _receive(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for datagrams, then take up to :data:`DRAIN_MAX` of them."""
        try:
            if not self._selector.select(max(0.0, wait_s)):
                return
            for _ in range(DRAIN_MAX):
                self._take(self._sock.recv(MAX_DATAGRAM + 1))
        except OSError:  # BlockingIOError: drained (or an ICMP error from an earlier send)
            return

    def _take(self, packet: bytes) -> None:
        body = packet[_MAC:]
        if not _MAC < len(packet) <= MAX_DATAGRAM or not hmac.compare_digest(
            packet[:_MAC], hmac.digest(self._key, body, hashlib.sha256)
        ):
            self.dropped["junk"] += 1  # not from this run: one HMAC is all junk costs
            return
        try:
            msg = json.loads(body)
            r, incarnation, n = int(msg["r"]), str(msg["i"]), int(msg["n"])
        except (ValueError, KeyError, TypeError):
            self.dropped["foreign"] += 1
            return
        if r not in self._peers or self._incarnations.setdefault(r, incarnation) != incarnation:
            self.dropped["foreign"] += 1  # (a rank restarted under the same key is another incarnation)
            return
        if n <= self._seen.get(r, 0):
            self.dropped["stale"] += 1  # a replay, or overtaken by a newer one: says nothing about now
            return
        self._seen[r] = n
        if msg.get("bye"):
            self._gone.add(r)
            return
        self._last[r] = time.monotonic()
        held = msg.get("h")
        if isinstance(held, list):
            self._held_by[r] = tuple(int(s) for s in held[:MAX_HELD] if isinstance(s, int))
        view = msg.get("v")
        if isinstance(view, list) and self.verdict is None:
            self._views[r] = tuple(sorted(int(x) for x in view if isinstance(x, int)))
            if self._detected is None:
                self._detected = time.monotonic()  # another rank saw a loss: settle with it

    def _survivors(self, now: float) -> tuple[int, ...]:
        heard = [r for r, t in self._last.items() if r not in self._gone and now - t < self.timeout_s]
        return tuple(sorted({self.rank, *heard}))

    def _run(self) -> None:
        next_send = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                next_send = now + self.interval_s
                try:
                    held = [int(s) for s in list(self._held())[-MAX_HELD:]]
                except Exception as err:  # the callback must never stop the heartbeat
                    log.debug("lightning_preempt: heartbeat: held steps unavailable: %s", err)
                    held = []
                self._held_by[self.rank] = tuple(held)
                extra: dict[str, Any] = {"h": held}
                if self._detected is not None:
                    extra["v"] = list(self._survivors(now))
                    next_send = now + min(self.interval_s, 0.1)  # settle fast
                self._send(extra)
            self._receive(min(self._wake_s, next_send - time.monotonic()))
            now = time.monotonic()
            survivors = self._survivors(now)
            if self._detected is None and any(r not in survivors and r not in self._gone for r in self._peers):
                self._detected = now
            if self._detected is not None and self._maybe_decide(now, survivors):
                return

    def _maybe_decide(self, now: float, survivors: tuple[int, ...]) -> bool:
        assert self._detected is not None
        lost = tuple(r for r in sorted(self._peers) if r not in survivors and r not in self._gone)
        if not lost and now - self._detected < self.timeout_s:
            return False  # another rank's loss that this one does not see (yet)
        same = all(self._views.get(r) == survivors for r in survivors if r != self.rank)
        if not (same and lost) and now - self._detected < self.settle_s + (0 if lost else self.timeout_s):
            return False
        if not lost:  # the loss another rank saw healed (or never was): forget it
            self._detected, self._views = None, {}
            return False
        silent = min(now - self._last.get(r, now) for r in lost)
        self.verdict = Verdict(
            rank=self.rank, world=self.world, survivors=survivors, lost=lost,
            agreed_step=agreed_step(self._held_by, survivors), quorum=has_quorum(survivors, self.world),
            agreed=same, silent_s=silent, detected_t=self._detected, decided_t=now,
        )  # fmt: skip
        for _ in range(2):  # tell the others the final view before acting on it
            self._send({"h": list(self._held_by.get(self.rank, ())), "v": list(survivors)})
        self._decided.set()
        try:
            self._on_verdict(self.verdict)
        except Exception as err:
            log.error("lightning_preempt: acting on the heartbeat verdict failed: %s", err)
        return True
