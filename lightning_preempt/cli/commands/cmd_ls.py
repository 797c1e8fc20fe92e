"""``lightning-preempt ls URL``: the checkpoints under URL, newest first. Needs no torch."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lightning_preempt.catalog.listing import CheckpointInfo
from lightning_preempt.cli.options import EXIT_OK, parse_storage_options
from lightning_preempt.cli.output import dash, print_table, utc
from lightning_preempt.cli.plan import format_bytes
from lightning_preempt.cli.resolve import list_or_self, nothing_here, storage_call
from lightning_preempt.errors import CheckpointError
from lightning_preempt.read.verify import verify_checkpoint
from lightning_preempt.storage.store import Store

HEADER = ["STEP", "EPOCH", "CREATED (UTC)", "SIZE", "WORLD", "TIER", "COMMITTED", "NAME"]


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ls", parents=parents, help="list checkpoints, newest first")
    p.add_argument("url", metavar="URL", help="directory of checkpoints (or one checkpoint directory)")
    p.add_argument("--verify", action="store_true", help="also check every file's size and CRC32C")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``ls URL``: a table (or JSON list) of the checkpoints under URL, newest first."""
    options = parse_storage_options(args.storage_options)
    infos = storage_call(args.url, lambda: list_or_self(args.url, options))
    if not infos:
        raise nothing_here(args.url, options)
    rows = []
    for info in infos:
        created = utc(info.created_unix) if info.created_unix is not None else None
        row = {**info.to_dict(), "created_utc": created, "tier": "primary"}  # two tiers will say "local" / "remote"
        if args.verify:
            row["verified"], row["verify_error"] = _verify_info(info, options)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        table = [[*HEADER, "VERIFIED" if args.verify else "NOTE"]]
        table += [_table_row(row, args.verify) for row in rows]
        print_table(table, right_aligned={0, 1, 3, 4})
    return EXIT_OK


def _table_row(row: dict[str, Any], verified: bool) -> list[str]:
    last = row.get("problem") or ""
    if verified:
        last = "ok" if row["verified"] else row["verify_error"]
    return [
        str(row["step"]),
        dash(row["epoch"]),
        row["created_utc"] or "-",
        format_bytes(row["size_bytes"]) if row["size_bytes"] is not None else "-",
        dash(row["world_size"]),
        row["tier"],
        "yes" if row["committed"] else "no",
        row["name"],
        last.replace(f" (checkpoint: {row['path']})", ""),  # the row names it already
    ]


def _verify_info(info: CheckpointInfo, options: dict[str, Any]) -> tuple[bool, str | None]:
    if not info.committed:
        return False, f"not committed: {info.problem or 'no manifest'}"
    try:
        verify_checkpoint(Store(info.path, options), info.manifest)
    except CheckpointError as err:
        return False, str(err).splitlines()[0]
    return True, None
