"""``lightning-preempt``: inspect, verify and export checkpoints; plan the save interval.

Exit codes: 0 success; 1 usage error, nothing found, unreachable storage or an unknown
format version; 2 a checkpoint that fails verification (or cannot be loaded because of it).
Every error is printed to stderr with a ``HINT:`` line saying what to do next.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from typing import IO, Any, NoReturn

from lightning_preempt.catalog.listing import CheckpointInfo, list_checkpoints
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
from lightning_preempt.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from lightning_preempt.format.manifest import Manifest
from lightning_preempt.format.names import DCP_METADATA_NAME, MANIFEST_NAME, is_checkpoint_file, state_ranks
from lightning_preempt.read.verify import read_manifest, verify_checkpoint
from lightning_preempt.storage.diagnose import storage_hint
from lightning_preempt.storage.store import Store

PROG = "lightning-preempt"
EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2
PROGRESS_MIN_BYTES = 64 << 20  # on a TTY, smaller checkpoints verify too fast to need a bar
MEASURE_BYTES = 256 << 20


class UsageError(CheckpointError):
    """Bad arguments or nothing to act on (exit code 1)."""


class StorageAccessError(CheckpointError):
    """The storage could not be reached or refused us (exit code 1)."""


# ---- entry point ---------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.debug:
        # fsspec drivers log every retry with a traceback; our error below says it once.
        for name in ("gcsfs", "s3fs", "aiobotocore", "botocore", "fsspec", "adlfs"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        result: int = args.func(args)
        return result
    except CorruptCheckpointError as err:
        if args.debug:
            traceback.print_exc()
        _print_error("INVALID", err)
        return EXIT_INVALID
    except CheckpointError as err:  # not found, unsupported version, usage, storage
        if args.debug:
            traceback.print_exc()
        _print_error("error", err)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lightning-preempt ls URL | head`
        return EXIT_OK


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors; here 2 means "invalid checkpoint", so exit 1."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\nHINT: `{self.prog} --help` lists the options.\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for every sub-command."""
    parser = _Parser(
        prog=PROG,
        description="Inspect, verify and export lightning_preempt checkpoints; plan how often to save.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and the storage drivers' logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    storage = _Parser(add_help=False)
    storage.add_argument(
        "--storage-option",
        "-o",
        dest="storage_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be, "
        "dotted keys nest (client_kwargs.region_name=eu-west-1). Never pass secrets here: the command line "
        "shows in `ps` and shell history; credentials come from environment variables and profiles",
    )

    p = sub.add_parser("ls", parents=[storage], help="list checkpoints, newest first")
    p.add_argument("url", metavar="URL", help="directory of checkpoints (or one checkpoint directory)")
    p.add_argument("--verify", action="store_true", help="also check every file's size and CRC32C")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("verify", parents=[storage], help="check a checkpoint's manifest, sizes and CRC32C")
    p.add_argument("url", metavar="URL", help="a checkpoint directory, or a directory of checkpoints")
    p.add_argument("step", metavar="STEP", nargs="?", type=int, help="step to verify (default: newest committed)")
    p.add_argument("--progress", action="store_true", help="show a progress bar on stderr even when not a TTY")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--trust",
        action="store_true",
        help="skip the check that the state loads without trust_checkpoints (allow-listed types only)",
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "export",
        parents=[storage],
        help="write one plain Lightning .ckpt file",
        description="Write the checkpoint URL (a checkpoint directory, or a directory of them: STEP picks one, "
        "default the newest committed) as ONE ordinary Lightning .ckpt file OUT.ckpt (local) that plain Lightning "
        "loads without lightning_preempt installed. Written atomically; never overwrites without --force.",
        usage=f"{PROG} export [-h] [--force] [--no-verify] [--trust] [-o KEY=VALUE] URL [STEP] OUT.ckpt",
    )
    p.add_argument("targets", nargs="+", metavar="URL [STEP] OUT.ckpt", help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help="replace OUT.ckpt if it exists")
    p.add_argument("--no-verify", action="store_true", help="skip the CRC32C check before exporting")
    p.add_argument(
        "--trust",
        action="store_true",
        help="unpickle the checkpoint's state without the allow-list (it can run code from the storage: only "
        "when you trust everyone who can write it; docs/security.md)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "plan",
        parents=[storage],
        help="optimal checkpoint interval (Young/Daly) and whether the SIGTERM snapshot fits",
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--state-bytes", type=_arg(parse_size), metavar="SIZE", help="checkpoint size, e.g. 1.5GB, 840GiB"
    )
    size.add_argument("--from", dest="from_url", metavar="URL", help="take the size of the newest committed checkpoint")
    bw = p.add_mutually_exclusive_group()
    bw.add_argument(
        "--write-bandwidth",
        type=_arg(parse_bandwidth),
        metavar="BW",
        help="storage write speed, all ranks together, e.g. 2GB/s",
    )
    bw.add_argument("--measure-dir", metavar="DIR", help="measure it: write and fsync a temporary file in DIR")
    p.add_argument(
        "--measure-bytes", type=_arg(parse_size), default=MEASURE_BYTES, metavar="SIZE", help=argparse.SUPPRESS
    )
    p.add_argument(
        "--mtbf",
        type=_arg(parse_duration),
        required=True,
        metavar="DURATION",
        help="mean time between preemptions, e.g. 4.5h, 30m",
    )
    p.add_argument(
        "--grace",
        type=_arg(parse_duration),
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help=f"SIGTERM-to-SIGKILL grace period (default {DEFAULT_GRACE_S:g}s)",
    )
    p.add_argument(
        "--blocking",
        type=_arg(parse_duration),
        metavar="SECONDS",
        help="seconds the training loop blocks per async save (default: measured in --from's "
        "manifest, else estimated as state / --copy-bandwidth)",
    )
    p.add_argument(
        "--copy-bandwidth",
        type=_arg(parse_bandwidth),
        default=DEFAULT_COPY_BANDWIDTH,
        metavar="BW",
        help="device -> host staging copy speed, all ranks together, for the blocking estimate (default 10GB/s)",
    )
    p.add_argument(
        "--restart",
        type=_arg(parse_duration),
        default=0.0,
        metavar="SECONDS",
        help="time to reschedule and reload after a preemption (default 0)",
    )
    p.add_argument("--step-time", type=_arg(parse_duration), metavar="SECONDS", help="seconds per training step")
    p.add_argument("--json", action="store_true", help="print every input and result as JSON")
    p.set_defaults(func=cmd_plan)
    return parser


# ---- ls ------------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    """``ls URL``: a table (or JSON list) of the checkpoints under URL, newest first."""
    options = parse_storage_options(args.storage_options)
    infos = _storage_call(args.url, lambda: _list_or_self(args.url, options))
    if not infos:
        raise _nothing_here(args.url, options)
    rows = []
    for info in infos:
        row = info_to_dict(info)
        if args.verify:
            row["verified"], row["verify_error"] = _verify_info(info, options)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    header = ["STEP", "EPOCH", "CREATED (UTC)", "SIZE", "WORLD", "TIER", "COMMITTED", "NAME"]
    header.append("VERIFIED" if args.verify else "NOTE")
    table = [header]
    for row in rows:
        last = row.get("problem") or ""
        if args.verify:
            last = "ok" if row["verified"] else row["verify_error"]
        last = last.replace(f" (checkpoint: {row['path']})", "")
        table.append(
            [
                str(row["step"]),
                _dash(row["epoch"]),
                row["created_utc"] or "-",
                format_bytes(row["size_bytes"]) if row["size_bytes"] is not None else "-",
                _dash(row["world_size"]),
                row["tier"],
                "yes" if row["committed"] else "no",
                row["name"],
                last,
            ]
        )
    _print_table(table, right_aligned={0, 1, 3, 4})
    return EXIT_OK


def info_to_dict(info: CheckpointInfo) -> dict[str, Any]:
    """JSON-ready description of one listed checkpoint (``ls --json`` rows)."""
    row = info.to_dict()
    row["created_utc"] = _utc(info.created_unix) if info.created_unix is not None else None
    row["tier"] = "primary"  # two-tier storage will report "local" / "remote" here
    return row


def _list_or_self(url: str, options: dict[str, Any]) -> list[CheckpointInfo]:
    store = Store(url, options)
    if store.exists(MANIFEST_NAME):  # URL is one checkpoint
        name = store.url.rstrip("/").rsplit("/", 1)[-1]
        try:
            m = read_manifest(store)
        except CheckpointError as err:
            return [CheckpointInfo(store.url, name, -1, committed=False, problem=str(err).splitlines()[0])]
        return [
            CheckpointInfo(
                store.url, name, m.step, True, m.epoch, m.created_unix, m.total_bytes, m.world_size, manifest=m
            )
        ]
    return list_checkpoints(url, options)


def _verify_info(info: CheckpointInfo, options: dict[str, Any]) -> tuple[bool, str | None]:
    if not info.committed:
        return False, f"not committed: {info.problem or 'no manifest'}"
    try:
        verify_checkpoint(Store(info.path, options), info.manifest)
    except CheckpointError as err:
        return False, str(err).splitlines()[0]
    return True, None


# ---- verify --------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    """``verify URL [STEP]``: manifest, then every file's size and CRC32C."""
    options = parse_storage_options(args.storage_options)
    store, manifest = _storage_call(args.url, lambda: resolve_checkpoint(args.url, args.step, options))
    total = manifest.total_bytes
    show = args.progress or (sys.stderr.isatty() and total >= PROGRESS_MIN_BYTES)
    bar = ProgressBar(total, f"verifying step {manifest.step}") if show else None
    started = time.perf_counter()
    try:
        _storage_call(store.url, lambda: verify_checkpoint(store, manifest, progress=bar.update if bar else None))
    finally:
        if bar is not None:
            bar.close()
    if not args.trust:
        _storage_call(store.url, lambda: check_loadable(store, manifest))
    elapsed = time.perf_counter() - started
    if args.json:
        print(
            json.dumps(
                {
                    "ok": True,
                    "path": store.url,
                    "step": manifest.step,
                    "files": len(manifest.files),
                    "bytes": total,
                    "seconds": elapsed,
                }
            )
        )
    else:
        print(
            f"OK step {manifest.step} ({store.url}): manifest v{manifest.version}, {len(manifest.files)} files, "
            f"{format_bytes(total)}, sizes and CRC32C match"
            f"{'' if args.trust else ', loads without trust_checkpoints'} ({elapsed:.2f}s)"
        )
    return EXIT_OK


def check_loadable(store: Store, manifest: Manifest) -> None:
    """Raise :class:`~lightning_preempt.safe_load.UntrustedCheckpointError` (naming the
    global) unless every rank's state and DCP's ``.metadata`` load with the allow-list only.
    Nothing from the checkpoint runs: that is what the allow-list guarantees."""
    from lightning_preempt.format.unpickle import UntrustedCheckpointError, read_dcp_metadata
    from lightning_preempt.read.load import load_skeleton  # imports torch: only when needed

    ranks = state_ranks(manifest.files)
    try:
        for rank in ranks:
            load_skeleton(store, manifest, rank)
        if DCP_METADATA_NAME in manifest.files:
            from lightning_preempt.format.layout import data_store

            read_dcp_metadata(data_store(store, manifest), manifest)
    except UntrustedCheckpointError as err:
        raise UntrustedCheckpointError(
            f"step {manifest.step}: sizes and CRC32C match, but {str(err).splitlines()[0]}",
            global_name=err.global_name,
            path=store.url,
            hint=err.hint,
        ) from None


def resolve_checkpoint(url: str, step: int | None, options: dict[str, Any]) -> tuple[Store, Manifest]:
    """The checkpoint ``url`` names: itself when it holds a manifest, else its ``step``
    (default: the newest committed) among the checkpoints under it."""
    store = Store(url, options)
    if store.exists(MANIFEST_NAME):
        manifest = read_manifest(store)
        if step is not None and step != manifest.step:
            raise UsageError(
                f"this checkpoint is step {manifest.step}, not {step}",
                path=store.url,
                hint="Pass the parent directory to choose by STEP, or omit STEP.",
            )
        return store, manifest
    infos = list_checkpoints(url, options)
    if not infos:
        if any(is_checkpoint_file(f) for f in store.list_files()):
            read_manifest(store)  # a checkpoint's files without its manifest: says "partial save"
        raise _nothing_here(url, options)
    committed = [c for c in infos if c.committed]
    if step is None:
        if not committed:
            raise NotACheckpointError(
                f"none of the {len(infos)} checkpoint directories is committed "
                f"({'; '.join(f'{c.name}: {c.problem}' for c in infos[:3])})",
                path=url,
                hint="They are partial saves or have a broken manifest; nothing here can be resumed from.",
            )
        newer = [c for c in infos if not c.committed and c.step > committed[0].step]
        for c in newer:
            print(f"note: skipping newer {c.name}: {c.problem}", file=sys.stderr)
        chosen = committed[0]
    else:
        matches = [c for c in infos if c.step == step]
        if not matches:
            steps = ", ".join(str(c.step) for c in committed) or "none"
            raise UsageError(
                f"no checkpoint of step {step}",
                path=url,
                hint=f"Committed steps here: {steps}. Run `{PROG} ls {url}` to see them all.",
            )
        good = [c for c in matches if c.committed]
        if not good:
            broken = Store(matches[0].path, options)
            if broken.exists(MANIFEST_NAME):
                read_manifest(broken)  # raises the precise error (corrupt / newer version)
            raise NotACheckpointError(
                f"checkpoint of step {step} is not committed: manifest.json is missing",
                path=matches[0].path,
                hint="It is a partial save (interrupted before its manifest was written); pick an older STEP.",
            )
        chosen = good[0]
    assert chosen.manifest is not None
    return Store(chosen.path, options), chosen.manifest


# ---- export --------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace) -> int:
    """``export URL [STEP] OUT.ckpt``: one plain Lightning checkpoint file."""
    from lightning_preempt.cli.export import export_checkpoint  # imports torch: only when needed

    targets: list[str] = args.targets
    if len(targets) not in (2, 3):
        raise UsageError(
            f"export takes URL [STEP] OUT.ckpt, got {len(targets)} argument(s)",
            hint=f"e.g. `{PROG} export gs://bucket/run 1500 model.ckpt`.",
        )
    url, out = targets[0], targets[-1]
    step = _int_arg(targets[1], "STEP") if len(targets) == 3 else None
    if "://" in out and not out.startswith("file://"):
        raise UsageError(
            "export writes a local file",
            path=out,
            hint="Export to a local path, then upload it (gsutil cp, aws s3 cp).",
        )
    out = out.removeprefix("file://")
    options = parse_storage_options(args.storage_options)
    store, manifest = _storage_call(url, lambda: resolve_checkpoint(url, step, options))
    started = time.perf_counter()
    result = _storage_call(
        url, lambda: export_checkpoint(store, out, force=args.force, verify=not args.no_verify, trusted=args.trust)
    )
    print(
        f"exported step {manifest.step} ({store.url}) -> {out}: {format_bytes(result.size_bytes)} in "
        f"{time.perf_counter() - started:.2f}s"
    )
    print(f"plain Lightning loads it: Trainer.fit(model, ckpt_path={out!r}) or Model.load_from_checkpoint({out!r})")
    if result.weights_only_error:
        print(
            f"note: torch.load(weights_only=True) rejects it ({result.weights_only_error});\n"
            "HINT: pass weights_only=False to load_from_checkpoint / torch.load for this file (trusted source only).",
            file=sys.stderr,
        )
    return EXIT_OK


# ---- plan ----------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    """``plan``: Young/Daly interval, flush clamp, expected loss, SIGTERM snapshot fit."""
    sources: dict[str, str] = {}
    options = parse_storage_options(args.storage_options)
    manifest: Manifest | None = None
    if args.from_url:
        store, manifest = _storage_call(args.from_url, lambda: resolve_checkpoint(args.from_url, None, options))
        state_bytes = manifest.total_bytes
        sources["state_bytes"] = f"size of step {manifest.step} in {store.url}: {state_bytes:,} B"
    else:
        state_bytes = args.state_bytes
        sources["state_bytes"] = f"--state-bytes: {state_bytes:,} B"

    write_s = manifest.stats.get("write_s") if manifest is not None else None
    if args.write_bandwidth is not None:
        bandwidth, sources["write_bandwidth"] = args.write_bandwidth, "--write-bandwidth"
    elif args.measure_dir:
        bandwidth = _storage_call(
            args.measure_dir, lambda: measure_write_bandwidth(args.measure_dir, args.measure_bytes, options)
        )
        sources["write_bandwidth"] = (
            f"measured: wrote and fsynced {format_bytes(args.measure_bytes)} in {args.measure_dir}"
        )
    elif manifest is not None and write_s:
        bandwidth = manifest.total_bytes / write_s
        sources["write_bandwidth"] = f"measured by the save of step {manifest.step} (manifest stats.write_s)"
    else:
        raise UsageError(
            "the write bandwidth is unknown",
            hint="Pass --write-bandwidth (e.g. 2GB/s) or --measure-dir DIR (a directory on the checkpoint storage).",
        )

    blocking_measured = manifest.stats.get("blocking_s") if manifest is not None else None
    if args.blocking is not None:
        blocking, sources["blocking_s"] = args.blocking, "--blocking"
    elif blocking_measured:
        blocking = blocking_measured
        sources["blocking_s"] = f"measured by the save of step {manifest.step if manifest else '?'} (manifest stats)"
    else:
        blocking = state_bytes / args.copy_bandwidth
        sources["blocking_s"] = (
            f"ESTIMATE: state / copy bandwidth {format_bytes(args.copy_bandwidth)}/s (--blocking to set)"
        )
    sources["mtbf_s"] = "--mtbf"
    sources["grace_s"] = "--grace" if args.grace != DEFAULT_GRACE_S else "default"
    inputs = PlanInputs(
        state_bytes=int(state_bytes),
        write_bandwidth=float(bandwidth),
        mtbf_s=float(args.mtbf),
        blocking_s=float(blocking),
        grace_s=float(args.grace),
        restart_s=float(args.restart),
        step_time_s=args.step_time,
    )
    try:
        plan = make_plan(inputs)
    except ValueError as err:
        raise UsageError(str(err), hint="Every input must be positive.") from None
    if args.json:
        print(json.dumps({**plan.to_dict(), "sources": sources}, indent=1))
    else:
        print(render_plan(plan, sources))
    return EXIT_OK


def render_plan(plan: Plan, sources: dict[str, str]) -> str:
    """The human-readable plan: every input, every formula, the recommendation."""
    i = plan.inputs
    pct = "{:.2%}".format
    lines = [
        "inputs",
        f"  S  state size            {format_bytes(i.state_bytes):>12}   ({sources['state_bytes']})",
        f"  B  write bandwidth       {format_bytes(i.write_bandwidth) + '/s':>12}   ({sources['write_bandwidth']})",
        f"  C  blocking per save     {format_duration(i.blocking_s):>12}   ({sources['blocking_s']})",
        f"  M  MTBF                  {format_duration(i.mtbf_s):>12}   ({sources['mtbf_s']})",
        f"  G  grace period          {format_duration(i.grace_s):>12}   ({sources['grace_s']})",
        f"  R  restart time          {format_duration(i.restart_s):>12}",
        f"     step time             {format_duration(i.step_time_s) if i.step_time_s else '-':>12}",
        "interval",
        f"  F = S/B (flush one save)                        {format_duration(plan.flush_s):>10}",
        f"  Young: sqrt(2CM)                                {format_duration(plan.young_s):>10}",
        f"  Daly:  sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C  {format_duration(plan.daly_s):>10}",
    ]
    rec = f"  recommended: max(Daly, F)                       {format_duration(plan.interval_s):>10}"
    if plan.clamped:
        rec += "   (clamped to F: at most one save is in flight)"
    lines.append(rec)
    if plan.interval_steps is not None:
        lines.append(
            f"  -> PreemptionCallback(every_n_train_steps={plan.interval_steps})   "
            f"(or every_n_seconds={plan.interval_s:.0f})"
        )
    else:
        lines.append(
            f"  -> PreemptionCallback(every_n_seconds={plan.interval_s:.0f})   (--step-time to convert to steps)"
        )
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


# ---- helpers -------------------------------------------------------------------------------
class ProgressBar:
    """A minimal stderr progress bar (about 10 redraws a second, then a final line)."""

    def __init__(self, total: int, label: str, stream: IO[str] | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.done = 0
        self._started = time.perf_counter()
        self._drawn = 0.0
        self._draw()

    def update(self, nbytes: int) -> None:
        """Count ``nbytes`` more (the ``progress`` callback of verify_checkpoint)."""
        self.done += nbytes
        now = time.perf_counter()
        if now - self._drawn >= 0.1:
            self._draw()

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._draw()
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self) -> None:
        self._drawn = time.perf_counter()
        frac = min(self.done / self.total, 1.0)
        width = 30
        filled = int(frac * width)
        rate = self.done / max(self._drawn - self._started, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {frac:6.1%} "
            f"{format_bytes(self.done)} / {format_bytes(self.total)} ({format_bytes(rate)}/s)"
        )
        self.stream.flush()


def parse_storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["anon=true", "client_kwargs.region_name=eu-west-1"]`` -> fsspec storage options."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option needs KEY=VALUE, got {pair!r}", hint="e.g. -o endpoint_url=http://...")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = options
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"--storage-option {key!r} conflicts with an earlier option")
        node[leaf] = value
    return options


def _storage_call(url: str, fn: Any) -> Any:
    """Run ``fn``; turn storage-layer failures (credentials, network, missing driver) into
    a :class:`StorageAccessError` whose HINT says what to set."""
    try:
        return fn()
    except CheckpointError:
        raise
    except FileNotFoundError as err:
        raise NotACheckpointError(
            f"not found ({err})", path=url, hint=f"Check the path; `{PROG} ls PARENT` lists checkpoints."
        ) from err
    except Exception as err:
        raise StorageAccessError(
            f"cannot access the storage: {type(err).__name__}: {err}", path=url, hint=storage_hint(url, err)
        ) from err


def _nothing_here(url: str, options: dict[str, Any]) -> NotACheckpointError:
    try:
        exists = Store(url, options).exists()
    except Exception:
        exists = True
    what = "has no checkpoints" if exists else "does not exist"
    return NotACheckpointError(
        f"{url} {what}",
        path=url,
        hint="Pass PreemptionCallback's dirpath (it holds step-NNNNNNNNNN/ directories) or one checkpoint "
        "directory (it holds manifest.json).",
    )


def _print_error(label: str, err: BaseException) -> None:
    print(f"{PROG}: {label}: {err}", file=sys.stderr)


def _print_table(rows: list[list[str]], right_aligned: set[int]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.rjust(w) if i in right_aligned else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())


def _utc(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _int_arg(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name} must be an integer step, got {text!r}") from None


def _arg(parse: Any) -> Any:
    """Wrap a plan parser for argparse: a ValueError becomes a clean usage message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


__all__ = ["build_parser", "main", "measure_write_bandwidth", "parse_storage_options", "resolve_checkpoint"]

if __name__ == "__main__":
    sys.exit(main())
