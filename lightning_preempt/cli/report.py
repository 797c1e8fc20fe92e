"""What ``lightning-preempt report`` computes: the run's figures from its ledger (or, without
one, from the retained checkpoints' manifests), the interval the ``plan`` model recommends
from what was measured, and the cost. No I/O beyond reading; no torch.
"""

from __future__ import annotations

import statistics
from typing import Any

from lightning_preempt.catalog.goodput import summarize
from lightning_preempt.catalog.ledger_reader import LedgerRead, read_ledger
from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.cli.plan import DEFAULT_COPY_BANDWIDTH, PlanInputs, lost_fraction, make_plan


def build_report(url: str, options: dict[str, Any], *, run: str | None = None, gpu_hour_price: float | None = None,
                 on_demand_price: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The report of the newest run under ``url`` (``run``: that run id); JSON-ready."""
    read = read_ledger(url, options, run=run)
    notes = list(read.notes)
    if not read.runs:
        report = from_manifests(url, options)
        why = f"no ledger of run {run}" if run is not None else "no goodput ledger under this URL (ledger=False?)"
        notes.insert(0, f"{why}: figures from the retained checkpoints' manifests only")
        report["notes"] = notes
        return report
    chosen = _newest_run(read)
    others = sorted(set(read.runs) - {chosen})
    if others:
        notes.append(f"{len(others)} other run(s) in this ledger ({', '.join(others[:5])}); --run ID reports one")
    ledger = read.runs[chosen]
    summary = summarize(ledger.records, ledger.folded_saves)
    summary["source"] = "ledger"
    summary["records"] = len(ledger.records)
    summary["plan"] = plan_from(summary)
    summary["cost"] = cost_from(summary, gpu_hour_price, on_demand_price)
    summary["notes"] = notes
    summary["timeline"] = timeline_points(ledger.records)
    return summary


def timeline_points(records: list[dict[str, Any]]) -> dict[str, list[list[Any]]]:
    """What the plot draws besides the segments: ``[t, step, restart]`` per record seen and
    ``[t, step, kind, blocking_s, committed_s]`` per save."""
    steps = [[r["t"] - (r["committed_s"] or 0.0) if r["kind"] == "save" else r["t"],  # a save: when it began
              r["resumed_step"] if r["kind"] == "start" else r["step"], r["restart"]]
             for r in records if r["kind"] in ("start", "progress", "save", "preemption", "finish")]  # fmt: skip
    saves = [[r["t"], r["step"], r["save_kind"], r["blocking_s"], r["committed_s"]] for r in records if r["kind"] == "save"]
    return {"steps": sorted(steps), "saves": saves}


def _newest_run(read: LedgerRead) -> str:
    return max(read.runs, key=lambda r: max(rec["t"] for rec in read.runs[r].records))


def plan_from(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The ``plan`` model fed with what the run measured: the periodic saves' median blocking
    time, size and bandwidth, the observed time between preemptions and the mean restart."""
    cost, preemptions = summary["save_cost"], summary["preemptions"]
    if cost is None or not preemptions or summary["wall_s"] <= 0:
        return None
    downs = [p["down_s"] for p in preemptions if p["down_s"] is not None]
    starts = [s["first_step_t"] - s["started_t"] for s in summary["segments"][1:]]
    restart = (statistics.mean(downs) if downs else 0.0) + (statistics.mean(starts) if starts else 0.0)
    mtbf = summary["wall_s"] / len(preemptions)
    step_s = summary["step_time_s"]
    bandwidth = cost["write_bandwidth"] if cost["write_bandwidth"] > 0 else DEFAULT_COPY_BANDWIDTH
    plan = make_plan(PlanInputs(
        state_bytes=max(1, int(cost["bytes"])), write_bandwidth=bandwidth, mtbf_s=mtbf, blocking_s=cost["blocking_s"],
        grace_s=summary["grace_period_s"] or 30.0, restart_s=restart, step_time_s=step_s or None,
    ))  # fmt: skip
    in_use = summary["every_n_seconds"]
    if summary["every_n_train_steps"] is not None and step_s:
        by_steps = summary["every_n_train_steps"] * step_s
        in_use = min(in_use, by_steps) if in_use is not None else by_steps
    blocking = max(cost["blocking_s"], 1e-9)
    return {
        "mtbf_s": mtbf,
        "restart_s": restart,
        "blocking_s": cost["blocking_s"],
        "recommended_s": plan.interval_s,
        "recommended_steps": plan.interval_steps,
        "in_use_s": in_use,
        "in_use_steps": summary["every_n_train_steps"],
        "lost_at_recommended": lost_fraction(plan.interval_s, blocking, mtbf, restart, rework=True),
        "lost_at_in_use": lost_fraction(in_use, blocking, mtbf, restart, rework=True) if in_use else None,
        "snapshot_fits": plan.snapshot_fits,
    }


def cost_from(summary: dict[str, Any], price: float | None, on_demand: float | None) -> dict[str, Any] | None:
    """What the run cost at ``price`` per GPU-hour (one GPU per rank) and, with ``on_demand``,
    what the same steps would cost there: no preemption, so no rework, restarts or time down."""
    if price is None:
        return None
    gpus = summary["world_size"]
    hours = summary["wall_s"] / 3600 * gpus
    out: dict[str, Any] = {"gpus": gpus, "gpu_hours": hours, "price": price, "cost": hours * price}
    out["lost_cost"] = (summary["wall_s"] - summary["useful_s"]) / 3600 * gpus * price
    if on_demand is not None:
        needed = max(0.0, summary["training_s"] - summary["lost_s"]) / 3600 * gpus
        out.update(on_demand_price=on_demand, on_demand_gpu_hours=needed, on_demand_cost=needed * on_demand,
                   saved=needed * on_demand - hours * price)  # fmt: skip
    return out


def from_manifests(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """What the committed checkpoints' manifests tell without a ledger: their steps, when
    they were made, their size and the blocking time each save recorded."""
    found = [c for c in list_checkpoints(url, options) if c.committed and c.manifest is not None]
    found.sort(key=lambda c: c.step)
    blocking = [c.manifest.stats["blocking_s"] for c in found
                if c.manifest is not None and isinstance(c.manifest.stats.get("blocking_s"), (int, float))]  # fmt: skip
    times = [c.created_unix for c in found if c.created_unix is not None]
    return {
        "source": "manifests",
        "checkpoints": len(found),
        "steps": [c.step for c in found],
        "first_t": min(times) if times else None,
        "end_t": max(times) if times else None,
        "last_step": found[-1].step if found else None,
        "bytes": found[-1].size_bytes if found else None,
        "blocking_s": statistics.median(blocking) if blocking else None,
        "run": found[-1].manifest.run_id if found and found[-1].manifest is not None else None,
    }
