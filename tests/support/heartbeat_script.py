"""One rank of a heartbeat mesh, as a plain process (no torch): for tests/unit/test_heartbeat*.py.

``python heartbeat_script.py DIR RANK WORLD HELD`` writes ``DIR/addr{RANK}.json`` (its
address and incarnation), waits for every rank's, beats, and on a verdict writes
``DIR/verdict{RANK}.json`` and exits with 75. ``DIR/bye{RANK}`` appearing makes it leave
cleanly (exit 0). ``HELD``: comma-separated steps this rank holds. ``HB_BUSY`` set: three
threads run Python without pause (holding the interpreter lock as a training step's Python
and its data loading do) until the bye.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

from lightning_preempt.collective.heartbeat import Heartbeat, Verdict


def _busy_until(path: str) -> None:
    while not os.path.exists(path):
        n = 0
        for i in range(200_000):  # pure Python: the interpreter lock is released only when forced
            n += i


def main() -> None:
    out, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    held = [int(s) for s in sys.argv[4].split(",") if s]
    timeout = float(os.environ.get("HB_TIMEOUT", "1.0"))

    def act(v: Verdict) -> None:
        with open(os.path.join(out, f"verdict{rank}.json.tmp"), "w") as f:
            json.dump({**dataclasses.asdict(v), "t": time.time()}, f)
        os.replace(os.path.join(out, f"verdict{rank}.json.tmp"), os.path.join(out, f"verdict{rank}.json"))
        os._exit(75)

    hb = Heartbeat(rank, world, key=b"k" * 32, held=lambda: held, on_verdict=act, interval_s=timeout / 8,
                   timeout_s=timeout, settle_s=timeout / 2, host="127.0.0.1")  # fmt: skip
    with open(os.path.join(out, f"addr{rank}.json.tmp"), "w") as f:
        json.dump([*hb.address, hb.incarnation], f)
    os.replace(os.path.join(out, f"addr{rank}.json.tmp"), os.path.join(out, f"addr{rank}.json"))
    peers: dict[int, tuple[str, int]] = {}
    incarnations: dict[int, str] = {}
    while len(peers) < world:
        for r in range(world):
            try:
                with open(os.path.join(out, f"addr{r}.json")) as f:
                    a = json.load(f)
                peers[r], incarnations[r] = (a[0], a[1]), a[2]
            except (OSError, ValueError):
                pass
        time.sleep(0.01)
    hb.start(peers, incarnations)
    open(os.path.join(out, f"started{rank}"), "w").close()
    bye = os.path.join(out, f"bye{rank}")
    if os.environ.get("HB_BUSY"):  # this thread and two more: the heartbeat gets a quarter of the lock
        for _ in range(2):
            threading.Thread(target=_busy_until, args=(bye,), daemon=True).start()
        _busy_until(bye)
    while not os.path.exists(bye):
        time.sleep(0.02)
    hb.stop(bye=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
