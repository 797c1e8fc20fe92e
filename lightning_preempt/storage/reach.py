"""Fail fast where a cloud driver would spend minutes: without credentials gcsfs probes the
metadata server (~15 s off a VM), then retries each request (~33 s) when the host does not
resolve; :func:`require_reachable` answers both in seconds (inconclusive answers pass). S3
needs nothing: botocore fails at once and diagnose.py says it is not worth a retry.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from lightning_preempt.errors import CheckpointError
from lightning_preempt.storage.diagnose import describe, storage_hint
from lightning_preempt.storage.protocols import GCS_PROTOCOLS

#: What gcsfs reads besides ``storage_options``: an emulator, a proxy, its browser-token cache.
_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
_GCSFS_TOKEN_CACHE = os.path.join("~", ".gcs_tokens")

_REACHED: set[tuple[str, str]] = set()


class StorageUnreachableError(CheckpointError):
    """The storage cannot be used at all from here: no credentials, or its host name does
    not resolve. Not worth a retry (storage/diagnose.py)."""


def require_reachable(protocol: str, options: dict[str, Any], url: str) -> None:
    """Raise :class:`StorageUnreachableError` when a GCS ``url`` has no credentials to find or
    no endpoint to resolve; anything else or inconclusive passes."""
    if protocol not in GCS_PROTOCOLS or "token" in options or "endpoint_url" in options or os.environ.get(_EMULATOR_ENV):
        return
    key = (protocol, os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", ""))
    if key in _REACHED:
        return
    _require_google_credentials(url)
    if not any(os.environ.get(name) for name in _PROXY_ENV):
        host = f"storage.{os.environ.get('GOOGLE_CLOUD_UNIVERSE_DOMAIN') or 'googleapis.com'}"
        require_host(host, url)
    _REACHED.add(key)


def _require_google_credentials(url: str) -> None:
    if os.path.exists(os.path.expanduser(_GCSFS_TOKEN_CACHE)):
        return  # gcsfs's own cache of browser tokens
    try:
        import google.auth
        import google.auth.exceptions
    except ImportError:  # gcsfs without google-auth: not ours to judge
        return
    try:
        # Files and the environment, then a ping of the metadata server (bounded by google-auth:
        # 3 s x 3 attempts at most when nothing answers; an unreachable address fails at once).
        google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    except google.auth.exceptions.DefaultCredentialsError as err:
        raise StorageUnreachableError(
            f"no usable Google Cloud credentials ({describe(err)})",
            path=url,
            hint=storage_hint(url, err),
        ) from err
    except Exception:  # e.g. a malformed key file: gcsfs reports it with its own words
        return


def require_host(host: str, url: str) -> None:
    """Raise :class:`StorageUnreachableError` when the resolver answers that ``host`` does
    not exist; a resolver that cannot answer now (``EAI_AGAIN``) passes."""
    try:
        socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno not in _NO_SUCH_NAME:
            return
        raise StorageUnreachableError(
            f"the storage endpoint {host} does not resolve (DNS: {err.strerror})",
            path=url,
            hint=storage_hint(url, err),
        ) from err


_NO_SUCH_NAME = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)}
