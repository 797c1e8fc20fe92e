"""What a storage error means: worth retrying or not, and its text with secrets redacted.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

from lightning_preempt.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    NotACheckpointError,
)

_FATAL_NAMES = re.compile(
    r"NoCredentialsError|PartialCredentialsError|DefaultCredentialsError|RefreshError|"
    r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|Forbidden|Unauthorized|PermissionError|"
    r"NoSuchBucket|\b40[13]\b"
)


def redact(text: str, options: dict[str, Any]) -> str:
    """``text`` with every secret-looking value of ``options`` replaced by ``***``."""
    for key, value in _flat(options):
        if isinstance(value, str) and len(value) >= 4 and key not in ("endpoint_url", "project", "region_name"):
            text = text.replace(value, "***")
    return text


def _flat(options: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if isinstance(options, dict):
        for k, v in options.items():
            out.extend(_flat(v, str(k)))
    else:
        out.append((prefix, options))
    return out


def is_transient(err: BaseException, permanent: tuple[type[BaseException], ...] = ()) -> bool:
    """Worth retrying: not a credentials / permission / exists / damaged-source error, nor
    one of ``permanent`` (anywhere in its chain of causes)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (CheckpointExistsError, CorruptCheckpointError, NotACheckpointError, *permanent)):
            return False
        if _FATAL_NAMES.search(type(e).__name__) or _FATAL_NAMES.search(str(e).split("\n", 1)[0]):
            return False
        e = e.__cause__ or e.__context__
    return True


def describe(err: BaseException, options: dict[str, Any]) -> str:
    """The first line of ``err`` (type and message) with ``options``' secrets redacted."""
    text = "".join(traceback.format_exception_only(type(err), err)).strip().splitlines()
    return redact(text[0] if text else type(err).__name__, options)

