"""Timing arithmetic shared by the retry policies and the informer (layer: k8s; pure, no I/O).

- ``Backoff``: jittered exponential delays with a cap;
- ``FailureBudget``: the rate bound. A caller gives up only when more than ``max_failures``
  consecutive failures fall within ``window`` seconds with no success in between, so a
  process that fails once an hour never gives up while one facing a dead API server does;
- ``parse_retry_after``: the ``Retry-After`` header, in seconds or as an HTTP date.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

# A server asking for a longer pause than this is believed only this far: a Retry-After of
# an hour from a misconfigured proxy must not park a controller for an hour.
RETRY_AFTER_CAP = 300.0


@dataclass(frozen=True, slots=True)
class Backoff:
    """``min(cap, base * 2**(n-1))`` for the n-th consecutive failure, scaled down by up to ``jitter``."""

    base: float
    cap: float
    jitter: float = 0.5  # fraction taken off at random: many clients failing together spread out

    def __post_init__(self) -> None:
        if not (0 < self.base <= self.cap) or not 0 <= self.jitter < 1:
            raise ValueError(f"bad backoff {self}")

    def delay(self, failures: int, *, retry_after: float | None = None, rng: random.Random | None = None) -> float:
        """Delay before the next try after ``failures`` (≥ 1) consecutive failures.

        A server's ``retry_after`` is a floor: we wait at least that long (up to ``RETRY_AFTER_CAP``),
        and never less than our own backoff.
        """
        exp = min(max(failures, 1) - 1, 64)  # 2**64 * base overflows nothing and is far past any cap
        raw = min(self.cap, self.base * math.pow(2.0, exp))
        delay = raw * (1.0 - self.jitter * (rng or _rng).random())
        if retry_after is not None:
            delay = max(delay, min(retry_after, RETRY_AFTER_CAP))
        return delay


_rng = random.Random()


@dataclass(kw_only=True)
class FailureBudget:
    """Consecutive failures within a sliding window; ``success()`` clears them."""

    max_failures: int
    window: float
    clock: Callable[[], float] = time.monotonic
    _times: deque[float] = field(default_factory=deque, init=False)

    def success(self) -> None:
        self._times.clear()

    def failure(self) -> int:
        """Record one failure; return the consecutive failures still inside the window."""
        now = self.clock()
        self._times.append(now)
        while self._times and self._times[0] < now - self.window:
            self._times.popleft()
        return len(self._times)

    @property
    def consecutive(self) -> int:
        return len(self._times)

    @property
    def exhausted(self) -> bool:
        return len(self._times) > self.max_failures


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or HTTP-date); None if absent or bad."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT; a naive parse means the zone was missing
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if math.isnan(seconds) or math.isinf(seconds):
        return None
    return max(0.0, seconds)
