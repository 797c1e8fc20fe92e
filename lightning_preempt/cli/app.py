"""``lightning-preempt``: the parser and dispatch. Exit codes: 0 success; 1 usage, nothing
found, storage, unknown format or untrusted state; 2 a checkpoint that fails verification.
Every error goes to stderr with a ``HINT:`` line.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from lightning_preempt.cli.commands import cmd_export, cmd_ls, cmd_plan, cmd_report, cmd_verify
from lightning_preempt.cli.options import EXIT_ERROR, EXIT_INVALID, EXIT_OK, PROG, storage_parent
from lightning_preempt.cli.output import print_error
from lightning_preempt.errors import CheckpointError, CorruptCheckpointError

COMMANDS = (cmd_ls, cmd_verify, cmd_export, cmd_plan, cmd_report)  # in the order --help lists them
_DRIVER_LOGGERS = ("gcsfs", "s3fs", "aiobotocore", "botocore", "fsspec", "adlfs")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.debug:
        # fsspec drivers log every retry with a traceback; our error below says it once.
        for name in _DRIVER_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        return int(args.func(args))
    except CorruptCheckpointError as err:
        _fail("INVALID", err, args.debug)
        return EXIT_INVALID
    except CheckpointError as err:  # not found, unsupported version, untrusted, usage, storage
        _fail("error", err, args.debug)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lightning-preempt ls URL | head`
        return EXIT_OK


def _fail(label: str, err: CheckpointError, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    print_error(label, err)


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors; here 2 means "invalid checkpoint", so exit 1."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\nHINT: `{self.prog} --help` lists the options.\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for every sub-command (each command module adds its own)."""
    parser = _Parser(
        prog=PROG,
        description="Inspect, verify and export lightning_preempt checkpoints; plan how often to save; "
        "report what preemption cost a run.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and the storage drivers' logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parents = [storage_parent()]
    for command in COMMANDS:
        command.add_parser(sub, parents)
    return parser
