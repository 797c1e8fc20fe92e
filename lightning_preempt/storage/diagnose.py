"""What a storage error means: worth retrying or not, what the user should set or install, and
its text with secrets redacted. The one place that classifies storage errors."""

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


_CREDENTIAL_HINTS = {
    "gs": "Set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or run "
    "`gcloud auth application-default login` (public buckets: -o token=anon).",
    "gcs": "Set GOOGLE_APPLICATION_CREDENTIALS, or run `gcloud auth application-default login`.",
    "s3": "Set AWS_PROFILE (a profile in ~/.aws/credentials) or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in "
    "the environment; never pass secrets with -o (they show in `ps`). For S3-compatible stores add "
    "-o endpoint_url=https://...",
    "az": "Set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and a key).",
    "abfs": "Set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and a key).",
}


_DRIVERS = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs", "abfs": "adlfs"}


def storage_hint(url: str, err: BaseException) -> str:
    """What to set or install when reaching ``url`` failed with ``err``."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    credentials = _CREDENTIAL_HINTS.get(protocol, "")
    text = f"{type(err).__name__} {err}".lower()
    if isinstance(err, ImportError):
        driver = _DRIVERS.get(protocol)
        return f"Install the fsspec driver for {protocol}://" + (f": pip install {driver}" if driver else ".")
    if isinstance(err, ValueError) and "protocol" in text:
        return "Use a local path or an fsspec URL such as gs://bucket/run, s3://bucket/run, memory://x."
    if protocol == "file":
        return "Check the path and that this user may read it."
    if any(w in text for w in ("credential", "auth", "token", "forbidden", "denied", "403", "401", "signature")):
        return credentials or "Check the credentials of the fsspec driver for this URL."
    if any(w in text for w in ("connect", "timeout", "timed out", "dns", "resolve", "unreachable", "network")):
        return "The storage endpoint cannot be reached: check the network, proxy and endpoint_url. " + credentials
    return credentials or "Check the URL, the network and the credentials of the fsspec driver for it."
