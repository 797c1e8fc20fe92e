"""The one place that classifies storage errors: :func:`classify` sorts an error into an
:data:`ErrorKind` from one table of words; :func:`is_transient` and :func:`storage_hint`
derive from it; :func:`describe` gives its first line, secrets redacted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from lightning_preempt.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, NotACheckpointError
from lightning_preempt.storage import protocols

ErrorKind = Literal[
    "credentials",  # no or bad credentials: nothing works until they are fixed
    "permission",  # the credentials work but may not do this
    "no_bucket",  # the bucket named in the URL does not exist
    "not_found",  # a file or object is missing (a listing may catch up: worth retrying)
    "missing_driver",  # the fsspec driver for the protocol is not installed
    "bad_protocol",  # not a URL fsspec knows
    "no_host",  # the endpoint's host name does not resolve (DNS: no such name)
    "network",  # the endpoint cannot be reached (for now)
    "exists",  # another writer's checkpoint is there
    "damaged",  # a checkpoint does not match its manifest, or is none
    "unknown",
]

#: Kinds a retry cannot fix.
_PERMANENT: frozenset[str] = frozenset(
    {"credentials", "permission", "no_bucket", "no_host", "missing_driver", "bad_protocol", "exists", "damaged"}
)

# Matched against "TypeName: first line of the message", lower case; the first kind that
# matches wins (a 403 that mentions a timeout is about permissions).
_WORDS: tuple[tuple[ErrorKind, re.Pattern[str]], ...] = (
    ("credentials", re.compile(
        r"credential|refresherror|invalidaccesskeyid|signature|unauthori[sz]ed|\b401\b|auth|token|anonymous caller"
    )),
    ("permission", re.compile(r"denied|forbidden|permissionerror|\b403\b")),
    ("no_bucket", re.compile(r"nosuchbucket")),
    # The resolver answered "no such name" (EAI_NONAME), unlike "temporary failure in name
    # resolution" (EAI_AGAIN, a network blip): a retry asks the same question again.
    ("no_host", re.compile(
        r"name or service not known|nodename nor servname|no address associated with hostname|getaddrinfo failed"
    )),
    ("network", re.compile(r"connect|timeout|timed out|dns|resolve|name resolution|unreachable|network")),
    ("not_found", re.compile(r"filenotfounderror|no such file|not found")),
)  # fmt: skip


def classify(err: BaseException) -> ErrorKind:
    """What kind of failure ``err`` is (its own type and first line only: a HINT below it is
    advice, not a symptom)."""
    if isinstance(err, CheckpointExistsError):
        return "exists"
    if isinstance(err, (CorruptCheckpointError, NotACheckpointError)):
        return "damaged"
    if isinstance(err, ImportError):
        return "missing_driver"
    if isinstance(err, ValueError) and "protocol" in str(err).lower():
        return "bad_protocol"
    if isinstance(err, PermissionError):
        return "permission"
    if type(err).__module__.startswith("google.auth"):
        # DefaultCredentialsError, RefreshError, and the TransportError of a metadata server
        # that is not there: every google.auth error means "no usable credentials"
        return "credentials"
    text = f"{type(err).__name__}: {str(err).split(chr(10), 1)[0]}".lower()
    return next((kind for kind, words in _WORDS if words.search(text)), "unknown")


def is_transient(err: BaseException, permanent: tuple[type[BaseException], ...] = ()) -> bool:
    """Worth retrying: no error in ``err``'s chain of causes is of a kind a retry cannot
    fix (credentials, permission, a missing bucket, exists, damaged…) or one of ``permanent``."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, permanent) or classify(e) in _PERMANENT:
            return False
        e = e.__cause__ or e.__context__
    return True


def redact(text: str, options: dict[str, Any]) -> str:
    """``text`` with every secret-looking value of ``options`` replaced by ``***``."""
    for key, value in _flat(options):
        if isinstance(value, str) and len(value) >= 4 and key not in ("endpoint_url", "project", "region_name"):
            text = text.replace(value, "***")
    return text


def _flat(options: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if not isinstance(options, dict):
        yield prefix, options
        return
    for k, v in options.items():
        yield from _flat(v, str(k))


def describe(err: BaseException, options: dict[str, Any] | None = None) -> str:
    """One line for ``err`` in a message or log: ours say what happened in their first line;
    any other error is ``TypeName: first line``. ``options``' secrets are redacted."""
    first = str(err).splitlines()[0] if str(err) else ""
    text = first if isinstance(err, CheckpointError) and first else (
        f"{type(err).__name__}: {first}" if first else type(err).__name__
    )  # fmt: skip
    return redact(text, options or {})


_GCS = (
    "Set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or run `gcloud auth application-default "
    "login` (on a Google Cloud VM: give it a service account). A public bucket read without credentials: "
    "storage_options={'token': 'anon'} (-o token=anon in the CLI)."
)
_AZURE = "Set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and a key)."
_CREDENTIAL_HINTS = {
    "gs": _GCS,
    "gcs": _GCS,
    "s3": "Set AWS_PROFILE (a profile in ~/.aws/credentials) or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in "
    "the environment; never pass secrets with -o (they show in `ps`). For S3-compatible stores add "
    "endpoint_url to storage_options (-o endpoint_url=https://... in the CLI).",
    "az": _AZURE,
    "abfs": _AZURE,
}


def storage_hint(url: str, err: BaseException) -> str:
    """What to set or install when reaching ``url`` failed with ``err``."""
    protocol = protocols.protocol_of(url)
    credentials = _CREDENTIAL_HINTS.get(protocol, "")
    kind = classify(err)
    if kind == "missing_driver":
        return protocols.install_hint(protocol)
    if kind == "bad_protocol":
        return protocols.unknown_hint(protocol)
    if protocol == "file":
        return "Check the path and that this user may read it."
    if kind in ("credentials", "permission"):
        return credentials or "Check the credentials of the fsspec driver for this URL."
    if kind == "no_host":
        return (
            "The storage endpoint's host name does not resolve (DNS): check the URL, endpoint_url, the network "
            "and the proxy (a machine without internet access cannot reach a cloud bucket)."
        )
    if kind == "network":
        return "The storage endpoint cannot be reached: check the network, proxy and endpoint_url. " + credentials
    return credentials or "Check the URL, the network and the credentials of the fsspec driver for it."
