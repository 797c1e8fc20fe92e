"""The verdict every recursive delete needs: proof that the tree was checked as ours.

Storage cannot tell what this package wrote, so every recursive delete demands an
:class:`Owned` for exactly its path; the one issuer is
:func:`lightning_preempt.catalog.ownership.check_owned`. Without one, it raises first.
"""

from __future__ import annotations

import dataclasses
import posixpath


@dataclasses.dataclass(frozen=True)
class Owned:
    """A directory checked as this package's (``path``: the store's native path)."""

    path: str


class UncheckedRemoveError(PermissionError):
    """A recursive delete was asked for without the ownership check of that path (a bug)."""


def require(owned: Owned | None, path: str) -> None:
    """Raise :class:`UncheckedRemoveError` unless ``owned`` vouches for ``path``."""
    if owned is None or _norm(owned.path) != _norm(path):
        raise UncheckedRemoveError(
            f"refusing to delete the directory {path}: its ownership was not checked"
            + (f" (the check was for {owned.path})" if owned is not None else "")
        )


def _norm(path: str) -> str:
    return posixpath.normpath(path.replace("\\", "/")) if path else path
