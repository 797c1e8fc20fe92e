"""One primitive for decisions that must be the same on every rank, errors included
(docs/design.md, "Agreed failures": an error on one rank alone leaves the others waiting).

* :func:`decide` — rank 0 runs ``fn`` and every rank gets its *result or its exception*;
* :func:`agree` — every rank runs ``fn``; if any failed, all raise the same error.

Every rank of ``group`` must make the same calls; without torch.distributed both run locally.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from lightning_preempt import errors
from lightning_preempt.collective import groups as pdist

T = TypeVar("T")

_HINT_MARK = "\nHINT: "


class RankFailedError(errors.CheckpointError):
    """A rank failed with an error that is not one of ours; raised alike on every rank."""

    error_type = ""  # the failed rank's "module.QualName" (set by Outcome.to_error)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one rank's ``fn`` did: a value, or an error described without pickling it."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""  # "module.QualName"
    message: str = ""
    hint: str | None = None
    path: str | None = None

    @classmethod
    def of(cls, fn: Callable[[], Any], rank: int) -> tuple[Outcome, BaseException | None]:
        """Run ``fn``; ``(outcome, the exception itself or None)``. ``KeyboardInterrupt`` and
        ``SystemExit`` are not caught (DCP's ``CheckpointException``, a ``BaseException``, is)."""
        try:
            return cls(rank=rank, ok=True, value=fn()), None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP raises CheckpointException, a BaseException
            return cls.failure(err, rank), err

    @classmethod
    def from_wire(cls, body: object) -> Outcome:
        """The outcome sent as ``dataclasses.asdict``; a field of the wrong type is refused, not trusted."""
        if (
            not isinstance(body, dict)
            or set(body) != {f.name for f in dataclasses.fields(cls)}
            or not isinstance(body["ok"], bool)
            or not isinstance(body["rank"], int)
            or not all(isinstance(body[k], str) for k in ("error_type", "message"))
            or not all(body[k] is None or isinstance(body[k], str) for k in ("hint", "path"))
        ):
            raise errors.CheckpointError(f"a rank's outcome arrived malformed: {str(body)[:200]!r}")
        return cls(**body)

    @classmethod
    def failure(cls, err: BaseException, rank: int) -> Outcome:
        text = str(err)
        hint = getattr(err, "hint", None)
        if hint is None and _HINT_MARK in text:
            text, hint = text.split(_HINT_MARK, 1)
        elif hint is not None:
            text = text.split(_HINT_MARK, 1)[0]
        kind = type(err)
        return cls(
            rank=rank,
            ok=False,
            error_type=f"{kind.__module__}.{kind.__qualname__}",
            message=text or kind.__name__,
            hint=hint,
            path=getattr(err, "path", None) if isinstance(getattr(err, "path", None), str) else None,
        )

    def to_error(
        self, what: str = "", *, foreign: type[errors.CheckpointError] | None = None, hint: str | None = None
    ) -> errors.CheckpointError:
        """The exception every rank raises for this outcome.

        Args:
            what: the step that failed, for the message ("committing the manifest").
            foreign: the class for an error that is not one of ours (an ``OSError`` from the
                storage…); default :class:`RankFailedError`.
            hint: the HINT when the error carries none.
        """
        prefix = f"{what} failed on rank {self.rank}: " if what else ""
        cls = _our_error_class(self.error_type)
        if cls is not None:
            return cls(prefix + self.message, path=self.path, hint=self.hint or hint)
        short = self.error_type.rsplit(".", 1)[-1]
        error = (foreign or RankFailedError)(
            f"{prefix or f'rank {self.rank}: '}{short}: {self.message}",
            path=self.path,
            hint=self.hint or hint or "See the error above; every rank stopped at the same point, nothing hangs.",
        )
        error.error_type = self.error_type  # type: ignore[attr-defined]
        return error


def _our_error_class(qualified: str) -> type[errors.CheckpointError] | None:
    """The class named ``module.Name`` when it is one of this package's errors (never imports
    anything outside the package: the name came over the wire)."""
    module, _, name = qualified.rpartition(".")
    if module != "lightning_preempt" and not module.startswith("lightning_preempt."):
        return None
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    if isinstance(cls, type) and issubclass(cls, errors.CheckpointError) and cls is not RankFailedError:
        return cls
    return None


def decide(
    fn: Callable[[], T],
    group: pdist.ProcessGroup | None,
    *,
    what: str = "",
    foreign: type[errors.CheckpointError] | None = None,
    hint: str | None = None,
    json_max_bytes: int | None = None,
) -> T:
    """Run ``fn`` on rank 0 of ``group``; every rank returns its result or raises its error
    (see :meth:`Outcome.to_error` for ``what``, ``foreign`` and ``hint``).

    With ``json_max_bytes`` the outcome travels as JSON of at most that many bytes
    (:func:`pdist.broadcast_json`), never pickled: for a value read from storage (a
    manifest), whose bytes must never reach an unpickler. ``fn`` then returns JSON values.

    Collective: every rank of ``group`` calls it, in the same order as its other collectives.
    """
    rank = pdist.rank(group) if group is not None else 0
    local_error: BaseException | None = None
    outcome: Outcome | None = None
    if rank == 0:
        outcome, local_error = Outcome.of(fn, rank)
    if group is not None and pdist.is_distributed() and json_max_bytes is not None:
        sent = dataclasses.asdict(outcome) if outcome is not None else None
        try:
            json.dumps(sent, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # fail on every rank, not on rank 0 alone
            unfit = TypeError(f"{what or 'the result'} is not JSON-serialisable")
            sent = dataclasses.asdict(Outcome.failure(unfit, rank))
        outcome = Outcome.from_wire(pdist.broadcast_json(sent, group, max_bytes=json_max_bytes))
    elif group is not None and pdist.is_distributed():
        outcome = pdist.broadcast_object(outcome, group)
    assert outcome is not None
    if outcome.ok:
        return outcome.value  # type: ignore[no-any-return]
    _raise(outcome.to_error(what, foreign=foreign, hint=hint), local_error)


def agree(
    fn: Callable[[], T],
    group: pdist.ProcessGroup | None,
    *,
    what: str = "",
) -> list[T]:
    """Run ``fn`` on every rank; return every rank's value, or raise the first failing rank's
    error on every rank (the message names all ranks that failed).

    Collective: every rank of ``group`` calls it.
    """
    outcomes, local_error = gather(fn, group)
    failed = [o for o in outcomes if not o.ok]
    if not failed:
        return [o.value for o in outcomes]
    first = failed[0]
    if len(failed) > 1:
        first = dataclasses.replace(first, message=f"{first.message} (ranks that failed: {[o.rank for o in failed]})")
    _raise(first.to_error(what), local_error)


def _raise(error: errors.CheckpointError, local_error: BaseException | None) -> NoReturn:
    """Raise the agreed ``error``; on the rank where it happened, chained to the original.

    When the original is one of ours, ``error`` already repeats its message and HINT: it takes
    over the original's traceback (where it was raised) and cause instead, so a user reads
    each message once, not twice."""
    if isinstance(local_error, errors.CheckpointError):
        raise error.with_traceback(local_error.__traceback__) from local_error.__cause__
    raise error from local_error


def gather(fn: Callable[[], T], group: pdist.ProcessGroup | None) -> tuple[list[Outcome], BaseException | None]:
    """Run ``fn`` on every rank; every rank gets every rank's :class:`Outcome` (in rank
    order) and its own exception, if any, to chain. :func:`agree` raises the first failure;
    a caller that words the error itself (the commit names every failed rank) starts here.

    Collective: every rank of ``group`` calls it.
    """
    mine, local_error = Outcome.of(fn, pdist.rank(group) if group is not None else 0)
    return pdist.all_gather_objects(mine, group), local_error
