"""Paper model of the seed's case: 64 GPUs (8 nodes x 8), 840 GB of state, one node
reclaimed with 30 s of grace, 16 preemptions in 72 h (docs/elastic-model.md).

Hardware figures are the seed's (or stated assumptions); the software overheads are the
ratios we measured on this machine (docs/benchmarks.md), applied to the hardware floors:

* staging blocks 1.02 x a copy into preallocated buffers (bench_save: ours / floor copy);
* a commit takes 1.33 x a sequential write + fsync of the same bytes (bench_save);
* a resize costs ~13 s of worker restart on top of loading (bench_elastic; mostly process
  start, which grows with the imports and NCCL set-up of a real job: we assume 45 s).

    python scripts/elastic_model.py
"""

from __future__ import annotations

import dataclasses
import math

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Case:
    state_bytes: float = 840 * GB
    nodes: int = 8
    gpus_per_node: int = 8
    grace_s: float = 30.0
    pcie_GBps: float = 15.4  # effective D2H per GPU: the seed's 13.12 GB in 0.85 s
    link_Gbps: float = 400.0  # one peer link
    links_per_node: int = 8  # p5.48xlarge: 8 x 400 Gb/s EFA; 1 for a single-NIC node
    link_efficiency: float = 0.8  # assumed: RDMA ~0.9, TCP/gloo lower; not measured here
    nvme_GBps: float = 12.0  # node-local RAID-0 NVMe, sequential write (assumed)
    bucket_GBps_per_node: float = 3.1  # the seed's sustained egress
    step_s: float = 10.0  # one optimizer step (assumed; the snapshot waits for its end)
    agree_interval_s: float = 0.25
    interval_s: float = 300.0  # periodic checkpoint every 5 min (the seed)
    hours: float = 72.0
    preemptions: int = 16
    replace_s: float = 360.0  # a replacement node arrives after 6 min (the seed)
    restart_s: float = 45.0  # new workers: processes, imports, NCCL init (assumed, see docstring)
    stage_ratio: float = 1.02  # measured: blocking / floor copy
    commit_ratio: float = 1.33  # measured: committed / (write + fsync)
    exit_s: float = 2.0  # interpreter shutdown after the snapshot (measured 1-2 s)

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def shard(self) -> float:
        return self.state_bytes / self.ranks

    @property
    def node_bytes(self) -> float:
        return self.shard * self.gpus_per_node

    def margin(self) -> float:
        return max(2.0, 0.1 * self.grace_s)


def grace_timeline(c: Case) -> list[tuple[str, float]]:
    """Seconds each phase of the emergency sequence takes on the leaving node."""
    link = c.link_Gbps / 8 * c.link_efficiency  # GB/s per link
    per_node_link = link * c.links_per_node
    replicate = c.node_bytes / GB / per_node_link
    direct = c.node_bytes / GB / c.bucket_GBps_per_node * c.commit_ratio
    return [
        ("notice -> agreed step (worst: a full step + the agreement interval)", c.step_s + c.agree_interval_s),
        ("stage the shard into host RAM (1.02 x PCIe copy)", c.stage_ratio * c.shard / GB / c.pcie_GBps),
        (f"replicate the node's {c.node_bytes / GB:.0f} GB to peers ({per_node_link:.0f} GB/s)", replicate),
        ("safety margin + interpreter exit", c.margin() + c.exit_s),
        (f"(instead of replicating: upload {c.node_bytes / GB:.0f} GB to the bucket)", direct),
    ]


def ram_per_node(c: Case, spread: bool) -> dict[str, float]:
    """Host RAM a surviving node needs during a preemption (GB)."""
    own = c.node_bytes / GB  # its own reusable staging buffers
    # spread: each leaving rank sends to a different survivor; else one buddy node takes all.
    incoming = math.ceil(c.gpus_per_node / (c.nodes - 1)) * c.shard / GB if spread else c.node_bytes / GB
    return {"staging buffers": own, "incoming replica": incoming, "total": own + incoming}


def goodput(c: Case, *, elastic: bool, replica: bool) -> dict[str, float]:
    """Fraction of 72 h of all GPUs spent on steps that are kept."""
    total = c.hours * 3600
    agreed, stage, _replicate, margin_exit, upload = (s for _, s in grace_timeline(c))
    save_overhead = stage / c.interval_s  # blocking per periodic save
    # Steps lost: 0 when the snapshot survives the node (replica, or the upload fits the grace);
    # else the survivors go back to the last periodic checkpoint in the bucket (on average
    # half an interval, plus the time its own upload lagged behind).
    fits = agreed + stage + upload + margin_exit <= c.grace_s
    lost = 0.0 if (replica or fits) else c.interval_s / 2 + upload
    load_local = c.state_bytes / GB / (c.nodes - 1) / c.nvme_GBps  # every survivor reads its share
    load_bucket = c.state_bytes / GB / ((c.nodes - 1) * c.bucket_GBps_per_node)
    load = load_local if replica else load_bucket
    if elastic:
        # leave: all stop for a restart at N-1; run at (N-1)/N until the node is back; join: restart again.
        per = (c.restart_s + load) + c.replace_s / c.nodes + (c.restart_s + load_local) + lost
    else:
        # wait for a replacement with every GPU idle, then restart at N.
        per = c.replace_s + c.restart_s + load + lost
    lost_s = c.preemptions * per
    return {
        "lost per preemption (s, whole-cluster equivalent)": per,
        "steps lost per preemption (s of training)": lost,
        "checkpoint overhead": save_overhead,
        "goodput": (1 - lost_s / total) * (1 - save_overhead),
    }


def main() -> None:
    for label, c in (("8 x 400 Gb/s per node (p5)", Case()), ("1 x 400 Gb/s per node", Case(links_per_node=1))):
        print(f"## {label}: shard {c.shard / GB:.2f} GB per rank, {c.node_bytes / GB:.0f} GB per node\n")
        print("| phase | seconds |\n|---|---|")
        for name, s in grace_timeline(c):
            print(f"| {name} | {s:.2f} |")
        tl = grace_timeline(c)
        used = tl[0][1] + tl[1][1] + tl[2][1] + tl[3][1]
        print(f"| **total with the replica** (grace {c.grace_s:.0f} s) | **{used:.2f}** |")
        print(f"\nlongest step that still fits: {c.grace_s - (used - c.step_s):.1f} s\n")
    c = Case()
    print(
        "## RAM per surviving node (GB)\n\n| scheme | staging buffers | incoming replica | total |\n|---|---|---|---|"
    )
    for spread in (True, False):
        r = ram_per_node(c, spread)
        name = "spread (rank i -> survivor i mod 7)" if spread else "buddy node"
        print(f"| {name} | {r['staging buffers']:.0f} | {r['incoming replica']:.0f} | {r['total']:.0f} |")
    print(f"\n## Goodput over {c.hours:.0f} h with {c.preemptions} preemptions\n")
    print("| mode | lost per preemption (s) | of which steps lost (s) | checkpoint overhead | goodput |")
    print("|---|---|---|---|---|")
    for elastic in (True, False):
        for replica in (True, False):
            g = goodput(c, elastic=elastic, replica=replica)
            name = f"{'elastic N-1' if elastic else 'wait for a replacement'}, {'peer replica' if replica else 'no replica'}"
            print(
                f"| {name} | {g['lost per preemption (s, whole-cluster equivalent)']:.0f} | "
                f"{g['steps lost per preemption (s of training)']:.0f} | {100 * g['checkpoint overhead']:.2f}% | "
                f"{100 * g['goodput']:.2f}% |"
            )


if __name__ == "__main__":
    main()
