"""``lightning-preempt export URL [STEP] OUT.ckpt``: one plain Lightning ``.ckpt`` file.

The only command that imports torch, and only when it runs (cli/export.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from lightning_preempt._text import untrusted_text
from lightning_preempt.cli.options import EXIT_OK, PROG, UsageError, int_arg, parse_storage_options
from lightning_preempt.cli.plan import format_bytes
from lightning_preempt.cli.resolve import resolve_checkpoint, storage_call


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        parents=parents,
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``export URL [STEP] OUT.ckpt``: one plain Lightning checkpoint file."""
    from lightning_preempt.cli.export import export_checkpoint  # imports torch: only when needed

    url, step, out = _targets(args.targets)
    options = parse_storage_options(args.storage_options)
    store, manifest = storage_call(url, lambda: resolve_checkpoint(url, step, options))
    started = time.perf_counter()
    result = storage_call(
        url, lambda: export_checkpoint(store, out, force=args.force, verify=not args.no_verify, trusted=args.trust)
    )
    print(
        f"exported step {manifest.step} ({untrusted_text(store.url, None)}) -> {untrusted_text(out, None)}: "
        f"{format_bytes(result.size_bytes)} in {time.perf_counter() - started:.2f}s"
    )
    print(f"plain Lightning loads it: Trainer.fit(model, ckpt_path={out!r}) or Model.load_from_checkpoint({out!r})")
    if result.weights_only_error:
        print(
            f"note: torch.load(weights_only=True) rejects it ({untrusted_text(result.weights_only_error, None)});\n"
            "HINT: pass weights_only=False to load_from_checkpoint / torch.load for this file (trusted source only).",
            file=sys.stderr,
        )
    return EXIT_OK


def _targets(targets: list[str]) -> tuple[str, int | None, str]:
    """``URL [STEP] OUT.ckpt`` -> (url, step, local output path)."""
    if len(targets) not in (2, 3):
        raise UsageError(
            f"export takes URL [STEP] OUT.ckpt, got {len(targets)} argument(s)",
            hint=f"e.g. `{PROG} export gs://bucket/run 1500 model.ckpt`.",
        )
    url, out = targets[0], targets[-1]
    step = int_arg(targets[1], "STEP") if len(targets) == 3 else None
    if "://" in out and not out.startswith("file://"):
        raise UsageError(
            "export writes a local file",
            path=out,
            hint="Export to a local path, then upload it (gsutil cp, aws s3 cp).",
        )
    return url, step, out.removeprefix("file://")
