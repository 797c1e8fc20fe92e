"""``lightning-preempt report URL``: what preemption cost a run: its figures from its ledger
(or, without one, from the retained checkpoints' manifests), the interval the ``plan`` model
recommends from what was measured, and the cost (the ``--plot``: cli/timeline.py, matplotlib
imported only then). No torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from lightning_preempt._text import untrusted_text
from lightning_preempt.catalog.goodput import summarize
from lightning_preempt.catalog.ledger_reader import read_ledger
from lightning_preempt.catalog.listing import list_checkpoints
from lightning_preempt.cli.options import EXIT_OK, PROG, UsageError, converter, parse_storage_options
from lightning_preempt.cli.output import dash, print_note, print_table, utc
from lightning_preempt.cli.plan import (
    DEFAULT_COPY_BANDWIDTH,
    PlanInputs,
    format_bytes,
    format_duration,
    lost_fraction,
    make_plan,
)
from lightning_preempt.cli.resolve import nothing_here, storage_call
from lightning_preempt.format.names import LEDGER_RUN_RE


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", parents=parents, help="what preemption cost a run: goodput, steps lost, time down")
    p.add_argument("url", metavar="URL", help="the callback's dirpath (local path or bucket URL)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw the run's timeline into this PNG file (needs matplotlib)")
    p.add_argument("--run", metavar="ID", help="report this run id (default: the newest run in the ledger)")
    price = converter(parse_price)
    p.add_argument("--gpu-hour-price", type=price, metavar="P", help="price of one GPU-hour (one GPU per rank)")
    p.add_argument("--on-demand-price", type=price, metavar="Q", help="on-demand GPU-hour price, to compare with")
    p.set_defaults(func=run)


def parse_price(text: str) -> float:
    """A price: a number in [0, 1e9)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"a price must be a number, got {text!r}") from None
    if not 0 <= value < 1e9:
        raise ValueError(f"a price must be >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """``report URL``: the run's figures as text (or JSON), and the timeline with ``--plot``."""
    if args.on_demand_price is not None and args.gpu_hour_price is None:
        raise UsageError(
            "--on-demand-price needs --gpu-hour-price", hint="e.g. --gpu-hour-price 1.2 --on-demand-price 3.9"
        )
    if args.run is not None and not LEDGER_RUN_RE.fullmatch(args.run):
        raise UsageError(f"--run {args.run!r} is not a run id", hint="The report's first line names the run id.")
    options = parse_storage_options(args.storage_options)
    report = storage_call(args.url, lambda: build_report(args.url, options, run=args.run, gpu_hour_price=args.gpu_hour_price,
                                                         on_demand_price=args.on_demand_price))  # fmt: skip
    if report["source"] == "manifests" and not report["checkpoints"]:
        raise nothing_here(args.url, options)
    if args.plot:
        if report["source"] != "ledger":
            raise UsageError(
                "--plot needs the goodput ledger", hint="Runs with PreemptionCallback(ledger=True) write one."
            )
        from lightning_preempt.cli.timeline import plot_timeline  # matplotlib: only here

        plot_timeline(report, args.plot, title=f"{args.url}")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report, args.url)
        if args.plot:
            print(f"Timeline: {untrusted_text(args.plot, None)}")
    for note in report["notes"]:
        print_note(f"{PROG}: note: {note}")
    return EXIT_OK


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
    chosen = max(read.runs, key=lambda r: max(rec["t"] for rec in read.runs[r].records))  # the newest
    others = sorted(set(read.runs) - {chosen})
    if others:
        notes.append(f"{len(others)} other run(s) in this ledger ({', '.join(others[:5])}); --run ID reports one")
    ledger = read.runs[chosen]
    summary = summarize(ledger.records, ledger.folded_saves)
    plan, cost = plan_from(summary), cost_from(summary, gpu_hour_price, on_demand_price)
    summary.update(source="ledger", records=len(ledger.records), plan=plan, cost=cost, notes=notes,
                   timeline=timeline_points(ledger.records))  # fmt: skip
    return summary


def timeline_points(records: list[dict[str, Any]]) -> dict[str, list[list[Any]]]:
    """What the plot draws besides the segments: ``[t, step, restart]`` per record seen and
    ``[t, step, kind, blocking_s, committed_s]`` per save."""
    steps = [[r["t"] - (r["committed_s"] or 0.0) if r["kind"] == "save" else r["t"],  # a save: when it began
              r["resumed_step"] if r["kind"] == "start" else r["step"], r["restart"]]
             for r in records if r["kind"] in ("start", "progress", "save", "preemption", "finish")]  # fmt: skip
    saves = [[r["t"], r["step"], r["save_kind"], r["blocking_s"], r["committed_s"]] for r in records if r["kind"] == "save"]
    return {"steps": sorted(steps), "saves": saves}


def plan_from(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The ``plan`` model fed with what the run measured: the periodic saves' median blocking
    time, size and bandwidth, the observed time between preemptions and the mean restart."""
    cost, preemptions = summary["save_cost"], summary["preemptions"]
    if cost is None or not preemptions or summary["wall_s"] <= 0:
        return None
    downs = [p["down_s"] for p in preemptions if p["down_s"] is not None]
    restart = statistics.mean(downs) if downs else 0.0  # down: end to the next first step, start-up included
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


def _d(seconds: float | None) -> str:
    return "-" if seconds is None else format_duration(max(0.0, seconds))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def print_report(r: dict[str, Any], url: str) -> None:
    """The text report (every text from storage escaped)."""
    show = untrusted_text
    if r["source"] == "manifests":
        print(f"{show(url, None)}: {r['checkpoints']} committed checkpoint(s), steps {r['steps'][0]}..{r['steps'][-1]}, "
              f"{format_bytes(r['bytes'] or 0)} each; saves blocked {_d(r['blocking_s'])} (median)")  # fmt: skip
        if r["first_t"] is not None:
            print(f"  oldest retained {utc(r['first_t'])}, newest {utc(r['end_t'])}")
        return
    n = len(r["preemptions"])
    state = "finished" if r["finished"] else "not finished (or still running)"
    print(f"Run {show(r['run'])} in {show(url, None)}: {r['processes']} process(es), {r['restarts']} restart(s), "
          f"step {r['last_step']}, {state}")  # fmt: skip
    if r["first_t"] is not None:
        print(f"  {utc(r['first_t'])} .. {utc(r['end_t'])}")
    restart_startup = r["startup_s"] - r["first_start_s"]
    rows = [
        ("wall time", _d(r["wall_s"]), "first process start to the last record = first start + training + down"),
        ("first start", _d(r["first_start_s"]), "to the first step: imports, set-up (a run never preempted pays it too)"),
        ("training", _d(r["training_s"]), f"{r['steps_trained']} steps, {_d(r['step_time_s'])} per step"),
        ("down", _d(r["down_s"]), f"{r['restarts']} restart(s): each process's end to the next one's first step "
         f"(teardown, queue, then {_d(restart_startup)} of start-up and resume)"),
        ("checkpoint overhead", _pct(r["checkpoint_overhead"]),
         f"{_d(r['checkpoint_blocking_s'])} blocked in {r['saves']} saves / training time"),
        ("steps lost", str(r["steps_lost"]), f"in {n} preemption(s): {_d(r['lost_s'])} of training redone"),
        ("goodput", _pct(r["goodput"]), "(training - blocking - redone) / (wall time - first start)"),
    ]  # fmt: skip
    drains = r.get("drains") or {}
    if drains.get("count"):
        rows.append(("uploads (two tiers)", str(drains["uploaded"]),
                     f"to dirpath, {drains['bytes'] / 1e6:.1f} MB in {_d(drains['drained_s'])}; newest step "
                     f"{dash(drains['newest_step'])}; {drains['skipped']} skipped, {drains['failed']} failed"))  # fmt: skip
    tier0 = r.get("tier0") or {}
    if tier0.get("count"):
        rows.append(("tier-0 copies", str(tier0["committed"]),
                     f"to host memory, newest step {dash(tier0['newest_step'])}, {_d(tier0['committed_s'])} each "
                     f"(median), {_d(tier0['blocking_s'])} blocked; {tier0['failed']} failed"))  # fmt: skip
    width = max(len(a) for a, _, _ in rows)
    for name, value, how in rows:
        print(f"  {name:<{width}}  {value:>9}  {how}")
    if n:
        print("Preemptions")
        table = [["#", "PROCESS", "SOURCE", "STEP", "AGREED AFTER", "SNAPSHOT", "RESUMED AT", "STEPS LOST",
                  "TO EXIT CALL", "DOWN"]]  # fmt: skip
        for i, p in enumerate(r["preemptions"], 1):
            snap = "-" if p["committed"] is None else "committed" if p["committed"] else "not committed"
            lost = dash(p["steps_lost"])
            lost = f">={lost}" if p["steps_lost_at_least"] and p["steps_lost"] is not None else lost
            resumed = dash(p["resumed_step"])
            tier = p.get("resumed_tier")
            resumed = f"{resumed} ({str(tier)[:12]})" if tier and p["resumed_step"] is not None else resumed
            table.append([str(i), str(p["restart"]), p["source"], str(p["step"]), _agreed_after(p), snap, resumed,
                          lost, _d(p["to_exit_s"]), _d(p["down_s"])])  # fmt: skip
        print_table(table, right_aligned={0, 1, 3, 4, 6, 7, 8, 9})
        print("  AGREED AFTER: from the first signal (on any rank) to the step every rank agreed to snapshot")
        print("  TO EXIT CALL: from the signal to the decision to exit (snapshot committed); the process is gone later (teardown, not seen "
              "by the ledger), which DOWN includes")  # fmt: skip
        print("  DOWN: from the process's end to the next one's first step (teardown, queue, start-up, resume)")
        if any(p["steps_lost_at_least"] for p in r["preemptions"]):
            print("  >=: killed without a record; steps after the last step the ledger saw are not counted")
    plan = r["plan"]
    if plan is not None:
        steps = f" = {plan['recommended_steps']} steps" if plan["recommended_steps"] else ""
        used = f"{_d(plan['in_use_s'])}" + (f" ({plan['in_use_steps']} steps)" if plan["in_use_steps"] else "")
        print(f"Save interval: in use {used if plan['in_use_s'] else 'none (only snapshots)'}; `plan` recommends "
              f"{_d(plan['recommended_s'])}{steps}")  # fmt: skip
        print(f"  what if every preemption were a hard kill (no snapshot: the steps since the last save redone): "
              f"{_pct(plan['lost_at_in_use'])} of the time lost at the interval in use, "
              f"{_pct(plan['lost_at_recommended'])} at the recommendation; from blocking {_d(plan['blocking_s'])} "
              f"per save, a preemption every {_d(plan['mtbf_s'])} and {_d(plan['restart_s'])} down per restart "
              f"(this run lost {r['steps_lost']} step(s))")  # fmt: skip
    cost = r["cost"]
    if cost is not None:
        line = (f"Cost: {cost['gpu_hours']:.3g} GPU-hours ({cost['gpus']} GPU(s)) at {cost['price']:g} = "
                f"{cost['cost']:.4g}, of which {cost['lost_cost']:.3g} paid no useful training")  # fmt: skip
        if "on_demand_cost" in cost:
            line += (f"; on demand at {cost['on_demand_price']:g}: {cost['on_demand_cost']:.4g} "
                     f"(saved {cost['saved']:.4g})")  # fmt: skip
        print(line)


def _agreed_after(p: dict[str, Any]) -> str:
    """``"2 steps, 0.31s"``: the preemption's signal-to-agreed latency; ``-`` where not recorded."""
    steps, seconds = p.get("agreed_after_steps"), p.get("agreed_after_s")
    if steps is None or seconds is None:
        return "-"
    return f"{steps} step{'s' if steps != 1 else ''}, {_d(seconds)}"
