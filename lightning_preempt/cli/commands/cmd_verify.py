"""``lightning-preempt verify URL [STEP]``: the manifest, every file's size and CRC32C, and
that the state loads without ``trust_checkpoints`` (its opcodes checked, without torch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from lightning_preempt._text import untrusted_text
from lightning_preempt.cli.options import EXIT_OK, parse_storage_options
from lightning_preempt.cli.output import ProgressBar
from lightning_preempt.cli.plan import format_bytes
from lightning_preempt.cli.resolve import resolve_checkpoint, storage_call
from lightning_preempt.errors import UntrustedCheckpointError
from lightning_preempt.format.manifest import Manifest, data_store
from lightning_preempt.format.names import DCP_METADATA_NAME, STATE_RE
from lightning_preempt.format.pickles.check import check_state_pickle
from lightning_preempt.format.pickles.metadata import check_metadata_pickle
from lightning_preempt.read.verify import verify_checkpoint
from lightning_preempt.storage.store import Store

PROGRESS_MIN_BYTES = 64 << 20  # on a TTY, smaller checkpoints verify too fast to need a bar


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("verify", parents=parents, help="check a checkpoint's manifest, sizes and CRC32C")
    p.add_argument("url", metavar="URL", help="a checkpoint directory, or a directory of checkpoints")
    p.add_argument("step", metavar="STEP", nargs="?", type=int, help="step to verify (default: newest committed)")
    p.add_argument("--progress", action="store_true", help="show a progress bar on stderr even when not a TTY")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--trust",
        action="store_true",
        help="skip the check that the state loads without trust_checkpoints (allow-listed types only)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``verify URL [STEP]``: manifest, then every file's size and CRC32C, then the pickles."""
    options = parse_storage_options(args.storage_options)
    store, manifest = storage_call(args.url, lambda: resolve_checkpoint(args.url, args.step, options))
    show = args.progress or (sys.stderr.isatty() and manifest.total_bytes >= PROGRESS_MIN_BYTES)
    bar = ProgressBar(manifest.total_bytes, f"verifying step {manifest.step}") if show else None
    started = time.perf_counter()
    try:
        storage_call(store.url, lambda: verify_checkpoint(store, manifest, progress=bar.update if bar else None))
    finally:
        if bar is not None:
            bar.close()
    if not args.trust:
        storage_call(store.url, lambda: check_loadable(store, manifest))
    elapsed, total = time.perf_counter() - started, manifest.total_bytes
    if args.json:
        fields = {"ok": True, "path": store.url, "step": manifest.step, "files": len(manifest.files)}
        print(json.dumps({**fields, "bytes": total, "seconds": elapsed}))
    else:
        print(
            f"OK step {manifest.step} ({untrusted_text(store.url, None)}): manifest v{manifest.version}, "
            f"{len(manifest.files)} files, {format_bytes(total)}, sizes and CRC32C match"
            f"{'' if args.trust else ', loads without trust_checkpoints'} ({elapsed:.2f}s)"
        )
    return EXIT_OK


def check_loadable(store: Store, manifest: Manifest) -> None:
    """Raise :class:`UntrustedCheckpointError` unless every pickle would load with the
    allow-list only; checked without torch (format/pickles/check.py, metadata.py)."""
    files = data_store(store, manifest)  # a replaced checkpoint's files live in its generation dir
    try:
        for name in sorted(n for n in manifest.files if STATE_RE.fullmatch(n)):  # every rank's
            check_state_pickle(files.read_bytes(name, manifest.files[name].size), path=store.url)
        entry = manifest.files.get(DCP_METADATA_NAME)
        if entry is not None:
            data = files.read_bytes(DCP_METADATA_NAME, entry.size)
            check_metadata_pickle(data, path=files.url, manifest=manifest)
    except UntrustedCheckpointError as err:
        raise UntrustedCheckpointError(
            f"step {manifest.step}: sizes and CRC32C match, but {str(err).splitlines()[0]}",
            global_name=err.global_name,
            path=store.url,
            hint=err.hint,
        ) from None
