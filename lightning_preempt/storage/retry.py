"""The one retry loop: attempts with exponential backoff, for storage that fails for a while.

Used by the drain (copying, then committing the manifest) and by the resume peek (listing
``dirpath`` before the process group exists). Who retries decides *what* is worth it
(``transient``) and *until when* (``give_up``, e.g. a grace-period deadline); in a collective
the decision is rank 0's for every rank (``decide``), so no rank retries into the next
attempt's collectives while another gives up.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _always(err: BaseException) -> bool:
    return True


def _never(delay: float) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class Backoff:
    """How often and how patiently to retry.

    Args:
        attempts: calls in all (1 = no retry).
        backoff_s: the wait before the second attempt; it doubles before each next one.
        transient: whether an error is worth another attempt.
        give_up: called with the next wait; ``True`` stops now (a deadline would pass).
        sleep: how to wait (tests pass a recorder).
    """

    attempts: int = 1
    backoff_s: float = 1.0
    transient: Callable[[BaseException], bool] = _always
    give_up: Callable[[float], bool] = _never
    sleep: Callable[[float], None] = time.sleep

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt number ``attempt`` (1-based)."""
        return self.backoff_s * 2 ** (attempt - 1)

    def should_retry(self, err: BaseException, attempt: int) -> bool:
        """Whether attempt ``attempt`` failing with ``err`` is followed by another."""
        return attempt < self.attempts and self.transient(err) and not self.give_up(self.delay(attempt))


def retry(
    fn: Callable[[int], T],
    policy: Backoff,
    *,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    decide: Callable[[Callable[[], bool]], bool] | None = None,
    retry_on: tuple[type[Exception], ...] = (Exception,),
) -> T:
    """``fn(attempt)`` (1-based) until it returns, re-raising its last error when
    ``policy`` says to stop.

    Args:
        on_retry: called with the error, the failed attempt and the wait before the next
            one (the log line).
        decide: runs ``policy.should_retry`` and returns its answer; a collective caller
            passes ``lambda q: agree.decide(q, group)`` so rank 0 decides for every rank
            (``fn`` must then fail alike on every rank, e.g. after gathering failures).
        retry_on: the errors considered at all; any other propagates at once (in a
            collective: one that did not fail alike on every rank).
    """
    attempt = 1
    while True:
        try:
            return fn(attempt)
        except retry_on as err:
            question = functools.partial(policy.should_retry, err, attempt)
            if not (question() if decide is None else decide(question)):
                raise
            delay = policy.delay(attempt)
            if on_retry is not None:
                on_retry(err, attempt, delay)
            policy.sleep(delay)
            attempt += 1
