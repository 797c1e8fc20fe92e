"""Tier 0 across two nodes: what the peer copy and the restore of a replacement node cost.

Two gloo ranks (torch.multiprocessing, loopback) play two nodes, each with its own tier-0
root under /dev/shm. Each round saves one replicated state as a tier-0 copy through the
real saver (each rank writes half: DCP splits it), waits for it to commit, then runs the
peer copy (engine/memory_tier.py ``after_copy``: each rank sends its half to the other
node) and waits for it. Both run on the saver's job thread in training, never on the
step; here each is timed on its own. Round 0 is a warm-up. At the end node 1's root is
wiped (a replacement node) and ``MemoryTier.setup`` restores the newest copy from node 0.

    python benchmarks/bench_tier0_peer.py              # 100 MiB, 5 rounds
    python benchmarks/bench_tier0_peer.py --size-mib 400 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MiB, fmt_range, machine_notes, median, table


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, work: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_preempt.collective.groups import new_gloo_group
    from lightning_preempt.engine.memory_tier import MemoryTier
    from lightning_preempt.save.order import SaveOrder
    from lightning_preempt.save.saver import Saver

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    root = os.path.join(work, f"node{rank}")
    saver = Saver({})
    saver.enable_collective(new_gloo_group())
    peer_group = new_gloo_group()
    tier = MemoryTier(root, every=1)
    assert tier.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: peer_group)
    g = torch.Generator().manual_seed(0)  # the same replicated state on both ranks
    state: dict[str, Any] = {"state_dict": {"w": torch.randn(args.size_mib * MiB // 4, generator=g)}}
    rows = []
    for step in range(1, args.rounds + 2):
        state["global_step"] = step
        path = tier.path(step, dist.group.WORLD)
        assert path is not None
        t0 = time.perf_counter()
        saver.save(state, SaveOrder(path))
        saver.wait()
        t1 = time.perf_counter()
        tier.after_copy(saver, path, "bench", leader=rank == 0)
        saver.wait()
        rows.append((t1 - t0, time.perf_counter() - t1))
    dist.barrier()
    if rank == 1:
        shutil.rmtree(root)
    dist.barrier()
    t0 = time.perf_counter()
    again = MemoryTier(root, every=1)
    assert again.setup(dist.group.WORLD, leader=rank == 0, new_group=lambda: peer_group, restore_floor=lambda: -1)
    restore_s = time.perf_counter() - t0
    saver.close()
    with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
        json.dump({"rounds": rows[1:], "restore_s": restore_s, "restored": again.restored_step}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    work = tempfile.mkdtemp(prefix="lp-bench-tier0-peer-", dir="/dev/shm")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_worker, args=(2, port, args, work), nprocs=2, join=True)
        out = [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # a round ends when both ranks are done: the slower rank's time
    write = [max(a[0], b[0]) for a, b in zip(out[0]["rounds"], out[1]["rounds"], strict=True)]
    peer = [max(a[1], b[1]) for a, b in zip(out[0]["rounds"], out[1]["rounds"], strict=True)]
    restore = max(o["restore_s"] for o in out)
    print(f"# tier 0 peer copy, {args.size_mib} MiB replicated state, 2 ranks / 2 nodes ({machine_notes()})\n")
    print(table(
        ["state (MiB)", "tier-0 write (s)", "peer copy (s)", "peer / write", "restore to an empty node (s)",
         "restored step"],
        [[str(args.size_mib), f"{median(write):.3f} ({fmt_range(write)})", f"{median(peer):.3f} ({fmt_range(peer)})",
          f"{median(peer) / median(write):.2f}", f"{restore:.3f}", str(out[1]["restored"])]],
    ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
