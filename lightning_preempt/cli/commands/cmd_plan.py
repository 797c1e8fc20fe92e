"""``lightning-preempt plan``: its inputs (flags, a manifest, a measured write) and the printed
plan; the math is cli/plan.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import uuid
from typing import Any

from lightning_preempt._text import untrusted_text
from lightning_preempt.cli.options import EXIT_OK, UsageError, converter, parse_storage_options
from lightning_preempt.cli.plan import (
    DEFAULT_COPY_BANDWIDTH,
    DEFAULT_GRACE_S,
    Plan,
    PlanInputs,
    format_bytes,
    format_duration,
    make_plan,
    parse_bandwidth,
    parse_duration,
    parse_size,
)
from lightning_preempt.cli.resolve import resolve_checkpoint, storage_call
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.storage.store import Store

MEASURE_BYTES = 256 << 20


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan", parents=parents, help="optimal checkpoint interval (Young/Daly) and whether the SIGTERM snapshot fits"
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--state-bytes", type=converter(parse_size), metavar="SIZE", help="checkpoint size, e.g. 1.5GB, 840GiB"
    )
    size.add_argument("--from", dest="from_url", metavar="URL", help="take the size of the newest committed checkpoint")
    bw = p.add_mutually_exclusive_group()
    bw.add_argument(
        "--write-bandwidth",
        type=converter(parse_bandwidth),
        metavar="BW",
        help="storage write speed, all ranks together, e.g. 2GB/s",
    )
    bw.add_argument("--measure-dir", metavar="DIR", help="measure it: write and fsync a temporary file in DIR")
    p.add_argument("--measure-bytes", type=converter(parse_size), default=MEASURE_BYTES, help=argparse.SUPPRESS)
    seconds = functools.partial(p.add_argument, type=converter(parse_duration), metavar="SECONDS")
    seconds("--mtbf", required=True, metavar="DURATION", help="mean time between preemptions, e.g. 4.5h, 30m")
    seconds("--grace", default=DEFAULT_GRACE_S, help=f"SIGTERM-to-SIGKILL grace period (default {DEFAULT_GRACE_S:g}s)")
    seconds(
        "--blocking",
        help="seconds the training loop blocks per async save (default: measured in --from's "
        "manifest, else estimated as state / --copy-bandwidth)",
    )
    p.add_argument(
        "--copy-bandwidth",
        type=converter(parse_bandwidth),
        default=DEFAULT_COPY_BANDWIDTH,
        metavar="BW",
        help="device -> host staging copy speed, all ranks together, for the blocking estimate (default 10GB/s)",
    )
    seconds("--restart", default=0.0, help="time to reschedule and reload after a preemption (default 0)")
    seconds("--step-time", help="seconds per training step")
    p.add_argument("--json", action="store_true", help="print every input and result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``plan``: Young/Daly interval, flush clamp, expected loss, SIGTERM snapshot fit."""
    sources: dict[str, str] = {}
    options = parse_storage_options(args.storage_options)
    manifest = _manifest(args, options, sources)
    state_bytes = manifest.total_bytes if manifest is not None else args.state_bytes
    inputs = PlanInputs(
        state_bytes=int(state_bytes),
        write_bandwidth=_bandwidth(args, manifest, options, sources),
        mtbf_s=float(args.mtbf),
        blocking_s=_blocking(args, manifest, state_bytes, sources),
        grace_s=float(args.grace),
        restart_s=float(args.restart),
        step_time_s=args.step_time,
    )
    sources["mtbf_s"] = "--mtbf"
    sources["grace_s"] = "--grace" if args.grace != DEFAULT_GRACE_S else "default"
    try:
        plan = make_plan(inputs)
    except ValueError as err:
        raise UsageError(str(err), hint="Every input must be positive.") from None
    if args.json:
        print(json.dumps({**plan.to_dict(), "sources": sources}, indent=1))
    else:
        print(untrusted_text(render_plan(plan, sources), None, keep_newlines=True))  # sources name a checkpoint
    return EXIT_OK


def _manifest(args: argparse.Namespace, options: dict[str, Any], sources: dict[str, str]) -> Manifest | None:
    """``--from``'s newest committed manifest (``None`` with ``--state-bytes``)."""
    if not args.from_url:
        sources["state_bytes"] = f"--state-bytes: {args.state_bytes:,} B"
        return None
    store, manifest = storage_call(args.from_url, lambda: resolve_checkpoint(args.from_url, None, options))
    sources["state_bytes"] = f"size of step {manifest.step} in {store.url}: {manifest.total_bytes:,} B"
    return manifest


def _bandwidth(
    args: argparse.Namespace, manifest: Manifest | None, options: dict[str, Any], sources: dict[str, str]
) -> float:
    """The write bandwidth: the flag, a measurement, or the manifest's own save."""
    write_s = manifest.stats.get("write_s") if manifest is not None else None
    if args.write_bandwidth is not None:
        sources["write_bandwidth"] = "--write-bandwidth"
        return float(args.write_bandwidth)
    if args.measure_dir:
        measured = storage_call(
            args.measure_dir, lambda: measure_write_bandwidth(args.measure_dir, args.measure_bytes, options)
        )
        sources["write_bandwidth"] = f"measured: wrote and fsynced {format_bytes(args.measure_bytes)} in {args.measure_dir}"
        return measured
    if manifest is not None and write_s:
        sources["write_bandwidth"] = f"measured by the save of step {manifest.step} (manifest stats.write_s)"
        return manifest.total_bytes / write_s
    raise UsageError(
        "the write bandwidth is unknown",
        hint="Pass --write-bandwidth (e.g. 2GB/s) or --measure-dir DIR (a directory on the checkpoint storage).",
    )


def _blocking(args: argparse.Namespace, manifest: Manifest | None, state_bytes: int, sources: dict[str, str]) -> float:
    """Seconds the loop blocks per save: the flag, the manifest's measurement, or an estimate."""
    measured = manifest.stats.get("blocking_s") if manifest is not None else None
    if args.blocking is not None:
        sources["blocking_s"] = "--blocking"
        return float(args.blocking)
    if manifest is not None and measured:
        sources["blocking_s"] = f"measured by the save of step {manifest.step} (manifest stats)"
        return float(measured)
    copy = format_bytes(args.copy_bandwidth)
    sources["blocking_s"] = f"ESTIMATE: state / copy bandwidth {copy}/s (--blocking to set)"
    return float(state_bytes / args.copy_bandwidth)


def render_plan(plan: Plan, sources: dict[str, str]) -> str:
    """The human-readable plan: every input, every formula, the recommendation."""
    i = plan.inputs
    lines = [
        "inputs",
        f"  S  state size            {format_bytes(i.state_bytes):>12}   ({sources['state_bytes']})",
        f"  B  write bandwidth       {format_bytes(i.write_bandwidth) + '/s':>12}   ({sources['write_bandwidth']})",
        f"  C  blocking per save     {format_duration(i.blocking_s):>12}   ({sources['blocking_s']})",
        f"  M  MTBF                  {format_duration(i.mtbf_s):>12}   ({sources['mtbf_s']})",
        f"  G  grace period          {format_duration(i.grace_s):>12}   ({sources['grace_s']})",
        f"  R  restart time          {format_duration(i.restart_s):>12}",
        f"     step time             {format_duration(i.step_time_s) if i.step_time_s else '-':>12}",
    ]
    rec = f"  recommended: max(Daly, F)                       {format_duration(plan.interval_s):>10}"
    if plan.clamped:
        rec += "   (clamped to F: one save writes at a time)"
    if plan.interval_steps is not None:
        hint = (
            f"  -> PreemptionCallback(every_n_train_steps={plan.interval_steps})   "
            f"(or every_n_seconds={plan.interval_s:.0f})"
        )
    else:
        hint = f"  -> PreemptionCallback(every_n_seconds={plan.interval_s:.0f})   (--step-time to convert to steps)"
    lines += [
        "interval",
        f"  F = S/B (flush one save)                        {format_duration(plan.flush_s):>10}",
        f"  Young: sqrt(2CM)                                {format_duration(plan.young_s):>10}",
        f"  Daly:  sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C  {format_duration(plan.daly_s):>10}",
        rec,
        hint,
    ]
    pct = "{:.2%}".format
    fits = "fits" if plan.snapshot_fits else "DOES NOT FIT"
    lines += [
        "SIGTERM snapshot",
        f"  C + F = {format_duration(plan.snapshot_s)}  vs  G - margin = {format_duration(plan.snapshot_budget_s)}"
        f"  -> {fits}",
        "expected time lost (at the recommended interval)",
        f"  hard kill, no snapshot:  C/tau + (tau/2 + R)/M = {pct(plan.lost_hard_kill)}",
        f"  SIGTERM snapshot fits:   C/tau + R/M           = {pct(plan.lost_with_snapshot)}"
        + ("" if plan.snapshot_fits else "   (not reachable: the snapshot does not fit)"),
    ]
    if not plan.snapshot_fits:
        lines.append(
            "HINT: the emergency snapshot will be killed mid-write; the previous periodic save is used. "
            "Use faster storage, a longer grace period, or accept the hard-kill loss above."
        )
    return "\n".join(lines)


def measure_write_bandwidth(url: str, nbytes: int = MEASURE_BYTES, options: dict[str, Any] | None = None) -> float:
    """Bytes/s for writing (and, on local disk, fsyncing) ``nbytes`` to a temp file in ``url``."""
    store = Store(url, options)
    store.makedirs()
    name = f".lightning-preempt-measure-{uuid.uuid4().hex}.tmp"
    chunk = os.urandom(min(nbytes, 8 << 20))
    started = time.perf_counter()
    try:
        with store.open_write(name) as f:
            left = nbytes
            while left > 0:
                f.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
        elapsed = time.perf_counter() - started
    finally:
        store.rm_file(name)
    return nbytes / max(elapsed, 1e-9)
