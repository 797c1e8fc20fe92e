"""``lightning-preempt report URL``: what preemption cost a run (figures: cli/report.py; the
``--plot``: cli/timeline.py, matplotlib imported only then).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_preempt._text import untrusted_text
from lightning_preempt.cli.options import EXIT_OK, PROG, UsageError, parse_storage_options
from lightning_preempt.cli.output import dash, print_note, print_table, utc
from lightning_preempt.cli.plan import format_bytes, format_duration
from lightning_preempt.cli.report import build_report
from lightning_preempt.cli.resolve import nothing_here, storage_call
from lightning_preempt.format.names import LEDGER_RUN_RE


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``report`` on the sub-command parser ``sub``."""
    p = sub.add_parser("report", parents=parents, help="what preemption cost a run: goodput, steps lost, time down")
    p.add_argument("url", metavar="URL", help="the callback's dirpath (local path or bucket URL)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw the run's timeline into this PNG file (needs matplotlib)")
    p.add_argument("--run", metavar="ID", help="report this run id (default: the newest run in the ledger)")
    p.add_argument("--gpu-hour-price", type=_price, metavar="P", help="price of one GPU-hour (one GPU per rank)")
    p.add_argument("--on-demand-price", type=_price, metavar="Q", help="on-demand GPU-hour price, to compare with")
    p.set_defaults(func=run)


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a price must be a number, got {text!r}") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"a price must be >= 0, got {text!r}")
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
    starts = r["processes"] or 1
    rows = [
        ("wall time", _d(r["wall_s"]), "first process start to the last record"),
        ("training", _d(r["training_s"]), f"{r['steps_trained']} steps, {_d(r['step_time_s'])} per step"),
        ("down (queued)", _d(r["down_s"]), "from each process's last record to the next start (teardown included)"),
        ("start to first step", _d(r["startup_s"]), f"{_d(r['startup_s'] / starts)} per start (imports, resume)"),
        ("checkpoint overhead", _pct(r["checkpoint_overhead"]),
         f"{_d(r['checkpoint_blocking_s'])} blocked in {r['saves']} saves / training time"),
        ("steps lost", str(r["steps_lost"]), f"in {n} preemption(s): {_d(r['lost_s'])} of training redone"),
        ("goodput", _pct(r["goodput"]), "(training - blocking - redone) / wall time"),
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
        table = [["#", "PROCESS", "SOURCE", "STEP", "SNAPSHOT", "RESUMED AT", "STEPS LOST", "TO EXIT CALL", "DOWN"]]
        for i, p in enumerate(r["preemptions"], 1):
            snap = "-" if p["committed"] is None else "committed" if p["committed"] else "not committed"
            lost = dash(p["steps_lost"])
            lost = f">={lost}" if p["steps_lost_at_least"] and p["steps_lost"] is not None else lost
            resumed = dash(p["resumed_step"])
            tier = p.get("resumed_tier")
            resumed = f"{resumed} ({str(tier)[:12]})" if tier and p["resumed_step"] is not None else resumed
            table.append([str(i), str(p["restart"]), p["source"], str(p["step"]), snap, resumed,
                          lost, _d(p["to_exit_s"]), _d(p["down_s"])])  # fmt: skip
        print_table(table, right_aligned={0, 1, 3, 5, 6, 7, 8})
        print("  TO EXIT CALL: from the signal to the decision to exit (snapshot committed); the process is gone later (teardown, not seen "
              "by the ledger), which DOWN includes")  # fmt: skip
        if any(p["steps_lost_at_least"] for p in r["preemptions"]):
            print("  >=: killed without a record; steps after the last step the ledger saw are not counted")
    plan = r["plan"]
    if plan is not None:
        steps = f" = {plan['recommended_steps']} steps" if plan["recommended_steps"] else ""
        used = f"{_d(plan['in_use_s'])}" + (f" ({plan['in_use_steps']} steps)" if plan["in_use_steps"] else "")
        print(f"Save interval: in use {used if plan['in_use_s'] else 'none (only snapshots)'}; `plan` recommends "
              f"{_d(plan['recommended_s'])}{steps}")  # fmt: skip
        print(f"  from blocking {_d(plan['blocking_s'])} per save, a preemption every {_d(plan['mtbf_s'])} "
              f"and {_d(plan['restart_s'])} per restart; expected time lost {_pct(plan['lost_at_in_use'])} now, "
              f"{_pct(plan['lost_at_recommended'])} at the recommendation (a hard kill each time)")  # fmt: skip
    cost = r["cost"]
    if cost is not None:
        line = (f"Cost: {cost['gpu_hours']:.3g} GPU-hours ({cost['gpus']} GPU(s)) at {cost['price']:g} = "
                f"{cost['cost']:.4g}, of which {cost['lost_cost']:.3g} paid no useful training")  # fmt: skip
        if "on_demand_cost" in cost:
            line += (f"; on demand at {cost['on_demand_price']:g}: {cost['on_demand_cost']:.4g} "
                     f"(saved {cost['saved']:.4g})")  # fmt: skip
        print(line)
