"""Retries of plain API requests, through tenacity, the way hynek/stamina wraps it (layer: k8s).

A ``RetryPolicy`` is named: the name is in every log line, in every ``RetryEvent`` handed to hooks
and in the ``RetryExhausted`` raised when it gives up. It caps attempts *and* total time, waits a
jittered exponential backoff (``dynsnap.k8s.backoff``) and honours a server's ``Retry-After`` as a
floor. It retries only what can heal by waiting (``is_retryable``):

    retried                                       never retried
    ApiError 429, 500, 502, 503, 504, other 5xx   ApiError 501 and every other 4xx (401/403/404/409/410/422)
    aiohttp connection errors (refused, reset,    TLS certificate errors (no wait fixes a wrong CA)
      server disconnected, connect/read timeouts)
    aiohttp payload errors (a body cut short)     anything else (bugs surface at once)
    ConnectionError, TimeoutError

A POST whose connection dropped after it was sent may be retried: with a fixed name the retry
answers 409 AlreadyExists (the object is there), with ``generateName`` it may create a second
object; dynsnap creates only Events that way, and a duplicate Event is harmless.

Instant mode, for tests: ``set_instant(True)`` (``set_instant(None)`` returns to the environment),
or ``DYNSNAP_RETRY_INSTANT=1`` in the environment. Sleeps then return at once, but every delay is
still chosen, logged, passed to hooks and counted against the policy's total-time cap as if it had
been slept, so a test sees exactly the decisions production would make, without the waiting. The
informer's reconnect loop sleeps through ``sleep`` here and so obeys the same switch.

Watches do not go through this module's policies: the informer runs its own reconnect loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TypeVar

import aiohttp
from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception

from dynsnap.k8s.backoff import Backoff
from dynsnap.k8s.errors import ApiError, RetryExhausted

log = logging.getLogger(__name__)

T = TypeVar("T")

INSTANT_ENV = "DYNSNAP_RETRY_INSTANT"

_instant: bool | None = None


def set_instant(on: bool | None) -> None:
    """Make every retry and reconnect sleep return at once (True), or not (False); None: use the env var."""
    global _instant
    _instant = on


def is_instant() -> bool:
    if _instant is not None:
        return _instant
    return os.environ.get(INSTANT_ENV, "") == "1"


async def sleep(delay: float) -> float:
    """Sleep ``delay`` seconds, or not at all in instant mode. Returns the seconds skipped (0 or ``delay``)."""
    if is_instant():
        await asyncio.sleep(0)  # still yield: a retry loop must never starve the event loop
        return delay
    await asyncio.sleep(delay)
    return 0.0


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """One decision of a policy: wait ``delay`` before attempt ``attempt + 1``, or give up."""

    policy: str
    what: str
    attempt: int
    delay: float
    error: BaseException
    gave_up: bool = False


_hooks: list[Callable[[RetryEvent], None]] = []


def add_hook(hook: Callable[[RetryEvent], None]) -> None:
    """Call ``hook`` on every retry decision (metrics, tests). Hooks must not raise."""
    _hooks.append(hook)


def remove_hook(hook: Callable[[RetryEvent], None]) -> None:
    if hook in _hooks:
        _hooks.remove(hook)


def _emit(event: RetryEvent) -> None:
    for hook in list(_hooks):
        try:
            hook(event)
        except Exception:  # a broken metrics hook must not turn a retry into a failure
            log.exception("retry hook %r failed", hook)


def is_retryable(exc: BaseException) -> bool:
    """Whether waiting and trying again can make ``exc`` go away (see the module docstring)."""
    if isinstance(exc, ApiError):
        return exc.status == 429 or (500 <= exc.status <= 599 and exc.status != 501)
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return False
    return isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | ConnectionError
                      | TimeoutError)


def retry_after_of(exc: BaseException | None) -> float | None:
    return exc.retry_after if isinstance(exc, ApiError) else None


@dataclass(frozen=True)
class RetryPolicy:
    """A named retry policy; ``await policy.call("GET /x", fn)`` runs ``fn`` under it."""

    name: str
    _: KW_ONLY
    attempts: int = 6
    timeout: float = 30.0  # total seconds, waits included, after which no new attempt starts
    backoff: Backoff = field(default_factory=lambda: Backoff(base=0.2, cap=5.0))

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.timeout <= 0:
            raise ValueError(f"bad retry policy {self}")

    async def call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        start = time.monotonic()
        skipped = 0.0  # seconds instant mode did not sleep; they still count against ``timeout``

        def elapsed() -> float:
            return time.monotonic() - start + skipped

        def wait(state: RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            return self.backoff.delay(state.attempt_number, retry_after=retry_after_of(exc))

        def stop(state: RetryCallState) -> bool:
            # Stop before a sleep that would end past the cap: sleeping only to give up is waste.
            return state.attempt_number >= self.attempts or elapsed() + state.upcoming_sleep > self.timeout

        async def do_sleep(delay: float) -> None:
            nonlocal skipped
            skipped += await sleep(delay)

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            assert exc is not None
            log.warning("retry policy %s: %s failed (attempt %d/%d): %s: %s; next try in %.2fs",
                        self.name, what, state.attempt_number, self.attempts, type(exc).__name__, exc,
                        state.upcoming_sleep)
            _emit(RetryEvent(self.name, what, state.attempt_number, state.upcoming_sleep, exc))

        retrying = AsyncRetrying(sleep=do_sleep, stop=stop, wait=wait, retry=retry_if_exception(is_retryable),
                                 before_sleep=before_sleep, name=self.name)
        try:
            async for attempt in retrying:
                with attempt:
                    return await fn()
        except RetryError as e:
            last = e.last_attempt.exception()
            assert last is not None
            attempts = e.last_attempt.attempt_number
            log.error("retry policy %s: gave up on %s after %d attempts (%.1fs): %s: %s",
                      self.name, what, attempts, elapsed(), type(last).__name__, last)
            _emit(RetryEvent(self.name, what, attempts, 0.0, last, gave_up=True))
            raise RetryExhausted(self.name, what, attempts=attempts, elapsed=elapsed(), last=last) from last
        raise AssertionError("unreachable: tenacity either returns, raises, or raises RetryError")


# Plain requests of controllers and agents. An API server restart or an etcd leader change
# takes a few seconds: six attempts over up to ~6 s of backoff ride through it, and 30 s in all
# keeps one reconcile from stalling longer than its own requeue would.
DEFAULT = RetryPolicy("k8s-request")

# No retries at all: for callers that run their own loop (the informer's list pages).
NONE = RetryPolicy("k8s-once", attempts=1)

# A Dynamo frontend's pages (its /metrics for demand, /v1/models), whose client raises
# ConnectionError for a request that got no answer: three tries within two seconds. The demand
# scrape runs again every scrape interval and a quiesce or verification asks again on its next
# look, so a longer wait here would only hold up the scrape of the other graphs or a reconcile.
FRONTEND = RetryPolicy("frontend-get", attempts=3, timeout=2.0, backoff=Backoff(base=0.1, cap=0.4))
