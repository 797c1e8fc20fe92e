"""What every command shares on the command line: the program name, exit codes, the usage
error, ``-o/--storage-option`` and argument converters. Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

from lightning_preempt.errors import CheckpointError

PROG = "lightning-preempt"
EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2


class UsageError(CheckpointError):
    """Bad arguments or nothing to act on (exit code 1)."""


def storage_parent() -> argparse.ArgumentParser:
    """The ``-o/--storage-option`` argument, as a parent parser for the commands that take a URL."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
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
    return parent


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
                raise UsageError(
                    f"--storage-option {key!r} conflicts with an earlier option",
                    hint=f"Pass either {part}=VALUE or {part}.KEY=VALUE options, not both.",
                )
        node[leaf] = value
    return options


def converter(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse's ``type=``: its ValueError becomes a clean usage message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


def int_arg(text: str, name: str) -> int:
    """``text`` as an integer step; a :class:`UsageError` naming ``name`` otherwise."""
    try:
        return int(text)
    except ValueError:
        raise UsageError(
            f"{name} must be an integer step, got {text!r}", hint=f"`{PROG} ls URL` lists the steps."
        ) from None
