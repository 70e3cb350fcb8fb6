"""Bounded retries with exponential backoff and jitter, inside one overall deadline.

Why these rules: UNAVAILABLE and RESOURCE_EXHAUSTED (HTTP 503) mean "not now" (starting,
draining, queue full), so trying again a little later usually works, but many clients retrying in
lock-step would hit an overloaded server in waves, hence the jitter. Attempts are bounded so a
dead server fails fast enough to notice, and every attempt and every sleep fits in the call's one
deadline: a retry never makes a call outlive the timeout its caller asked for.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from mariner.client.errors import DeadlineExceededError, MarinerError, Status

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry.

    Attempt k (k >= 1) that failed retryably is followed by a sleep of
    `min(max_backoff_s, initial_backoff_s * multiplier**(k-1))`, reduced by up to `jitter` of
    itself at random (jitter 0.5: between half and all of it), or the server's Retry-After hint
    when that is longer (still capped at `max_backoff_s`). `max_attempts=1` disables retries.
    """

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be within [0, 1], got {self.jitter}")

    def backoff(self, attempt: int, rand: float, hint_s: float | None = None) -> float:
        """Seconds to sleep after failed attempt number `attempt` (1-based); `rand` in [0, 1)."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        delay = cap * (1.0 - self.jitter * rand)
        if hint_s is not None:
            delay = max(delay, min(hint_s, self.max_backoff_s))
        return delay


NO_RETRY = RetryPolicy(max_attempts=1)


class Deadline:
    """One absolute instant (time.monotonic) shared by every attempt of a call; None = unbounded."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        return self.at - time.monotonic()

    def expired(self) -> bool:
        left = self.remaining()
        return left is not None and left <= 0


def call_with_retry(
    attempt: Callable[[float | None], T],
    policy: RetryPolicy,
    deadline: Deadline,
    *,
    transport: str,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random,
) -> T:
    """Run `attempt(seconds_left)` until it succeeds, fails for good, or tries/time run out.

    `attempt` raises `MarinerError`; retryable ones are tried again after the policy's backoff.
    When the next sleep would pass the deadline the last error is raised at once (its `attempts`
    says how many were made) rather than sleeping into a certain DEADLINE_EXCEEDED.
    """
    tries = 0
    while True:
        left = deadline.remaining()
        if left is not None and left <= 0:
            raise DeadlineExceededError(
                Status.DEADLINE_EXCEEDED,
                f"{what}: deadline of {deadline.timeout_s:g}s passed before an answer",
                transport=transport,
                attempts=max(tries, 1),
            )
        tries += 1
        try:
            return attempt(left)
        except MarinerError as err:
            err.attempts = tries
            if not err.retryable or tries >= policy.max_attempts:
                raise
            delay = policy.backoff(tries, rand(), err.retry_after_s)
            left = deadline.remaining()
            if left is not None and delay >= left:
                raise
            sleep(delay)
