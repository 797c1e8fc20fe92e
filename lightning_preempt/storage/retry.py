"""The one retry loop: attempts with exponential backoff. The caller decides what is worth it
(``transient``) and until when (``give_up``); in a collective rank 0 decides for every rank
(``decide``), so no rank retries into collectives another has given up on.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Backoff:
    """``attempts`` calls in all; ``backoff_s`` doubles after each; ``give_up(next wait)``
    stops early (a deadline would pass)."""

    attempts: int = 1
    backoff_s: float = 1.0
    transient: Callable[[BaseException], bool] = lambda err: True
    give_up: Callable[[float], bool] = lambda delay: False
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
    ``policy`` says to stop. ``decide``: a collective caller passes
    ``lambda q: agree.decide(q, group)`` (``fn`` must then fail alike on every rank);
    errors outside ``retry_on`` propagate at once.
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
