"""Which URLs the storage can open: a protocol fsspec knows, whose driver is installed.
Checked when options are validated, so ``gs://…`` without gcsfs fails at construction,
not at ``fit``; the same texts are :func:`storage.diagnose.storage_hint`'s HINTs.
"""

from __future__ import annotations

import difflib

import fsspec
from fsspec.core import split_protocol
from fsspec.registry import known_implementations, registry

#: Protocols of object stores: an object ``P`` and objects under ``P/`` can coexist, a
#: "directory" is a prefix, and ``mv`` is copy + delete (never commit by renaming there).
OBJECT_STORES = frozenset({"gs", "gcs", "s3", "s3a"})
GCS_PROTOCOLS = frozenset({"gs", "gcs"})
#: The package's extras that install a protocol's driver (pyproject.toml).
_EXTRAS = {"gs": "gcs", "gcs": "gcs", "s3": "s3", "s3a": "s3"}
#: Drivers of other common protocols, by package name.
_DRIVERS = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}


def protocol_of(url: str) -> str:
    """The protocol of ``url`` as the storage layer reads it (``"file"`` for a local path)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def protocols_in(url: str) -> list[str]:
    """Every protocol ``url`` names (``simplecache::gs://b`` names two); ``[]`` for a local path."""
    parts = url.split("::")
    out = []
    for i, part in enumerate(parts):
        proto = split_protocol(part)[0]
        if proto is None and i < len(parts) - 1 and part and "/" not in part:
            proto = part  # a bare protocol ahead of "::" (fsspec's chained URLs)
        if proto:
            out.append(str(proto).lower())
    return out


def known_protocols() -> list[str]:
    """The protocols fsspec knows (built in, or registered by an installed package)."""
    return sorted(set(known_implementations) | set(registry))


def install_hint(protocol: str) -> str:
    """What to install for ``protocol``'s driver."""
    extra = _EXTRAS.get(protocol)
    if extra is not None:
        return f"pip install 'lightning_preempt[{extra}]' (installs {_DRIVERS[protocol]}, the fsspec driver for {protocol}://)."
    driver = _DRIVERS.get(protocol)
    if driver is not None:
        return f"pip install {driver} (the fsspec driver for {protocol}://)."
    text = str(known_implementations.get(protocol, {}).get("err", "")).strip()
    return text or f"Install the fsspec driver for {protocol}://."


def unknown_hint(protocol: str) -> str:
    """What to write instead of the unknown ``protocol``."""
    known = known_protocols()
    close = difflib.get_close_matches(protocol, known, n=3, cutoff=0.6)
    guess = f"Did you mean {' or '.join(f'{p}://' for p in close)}? " if close else ""
    return (
        f"{guess}Use a local path or a URL whose protocol fsspec knows, e.g. gs://bucket/run, s3://bucket/run; "
        f"known protocols: {', '.join(known)}."
    )


def check_driver(url: str, *, name: str = "the URL") -> None:
    """``ValueError`` (unknown protocol) or ``ImportError`` (no driver) with a HINT when ``url``
    cannot be opened whatever the credentials; ``name``: the option that holds it."""
    for protocol in protocols_in(url):
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as err:
            raise ImportError(
                f"{name} {url!r} needs the fsspec driver for {protocol}://, which is not installed"
                f"\nHINT: {install_hint(protocol)}"
            ) from err
        except ValueError as err:
            raise ValueError(f"{name} {url!r}: unknown protocol {protocol!r}\nHINT: {unknown_hint(protocol)}") from err
