"""A work queue of keys for level-triggered reconcilers, after controller-runtime's:

- a key waiting in the queue is there once, however often it is added (dedupe);
- a key being processed is never handed to a second worker; adding it meanwhile marks it dirty
  and it comes back once the first worker is done;
- ``add_after`` schedules a key for later (the reconcile's "look again after T");
- ``add_rate_limited`` backs off per key (doubling from ``base`` to ``cap``) until ``forget``.

And the workers that drain it: :func:`run_workers` calls ``reconcile(key)``, which returns the
seconds after which to look again (or None); an exception is logged and the key retried with
backoff. No sleeps in reconcilers: waiting is the queue's job.

Layer: ``dynsnap.runtime`` (knows nothing about Kubernetes objects or Dynamo).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)


class ShutDown(Exception):
    """The queue was shut down; workers stop."""


@dataclass
class QueueStats:
    adds: int = 0
    reconciles: int = 0
    errors: int = 0
    retries: int = 0


@dataclass
class WorkQueue(Generic[K]):
    base_delay: float = 0.05
    max_delay: float = 300.0
    _ready: list[K] = field(default_factory=list)
    _queued: set[K] = field(default_factory=set)
    _processing: set[K] = field(default_factory=set)
    _dirty: set[K] = field(default_factory=set)
    _failures: dict[K, int] = field(default_factory=dict)
    _timers: list[tuple[float, int, K]] = field(default_factory=list)
    _seq: int = 0
    _shutdown: bool = False
    stats: QueueStats = field(default_factory=QueueStats)

    def __post_init__(self) -> None:
        self._wakeup = asyncio.Event()

    def __len__(self) -> int:
        return len(self._ready)

    @property
    def depth(self) -> int:
        """Keys waiting now (not counting those scheduled for later or being processed)."""
        return len(self._ready)

    def add(self, key: K) -> None:
        if self._shutdown:
            return
        self.stats.adds += 1
        if key in self._processing:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        self._ready.append(key)
        self._wakeup.set()

    def add_after(self, key: K, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        self._seq += 1
        heapq.heappush(self._timers, (time.monotonic() + delay, self._seq, key))
        self._wakeup.set()

    def add_rate_limited(self, key: K) -> float:
        n = self._failures.get(key, 0)
        self._failures[key] = n + 1
        delay = min(self.base_delay * 2.0 ** min(n, 30), self.max_delay)
        self.stats.retries += 1
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        return self._failures.get(key, 0)

    def _promote_timers(self) -> float | None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, key = heapq.heappop(self._timers)
            self.add(key)
        return self._timers[0][0] - now if self._timers else None

    async def get(self) -> K:
        while True:
            if self._shutdown:
                raise ShutDown
            wait = self._promote_timers()
            if self._ready:
                key = self._ready.pop(0)
                self._queued.discard(key)
                self._processing.add(key)
                return key
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait if wait is not None else 3600.0)

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def shutdown(self) -> None:
        self._shutdown = True
        self._wakeup.set()


Reconcile = Callable[[K], Awaitable[float | None]]


async def run_workers(queue: WorkQueue[K], reconcile: Reconcile[K], *, workers: int,
                      name: str = "reconcile", timeout: float | None = None) -> None:
    """Drain ``queue`` with ``workers`` concurrent workers until it is shut down. With ``timeout``, a reconcile
    that has not returned within it is cancelled and counted as failed (its key again after the rate limiter's
    delay): one key whose reconcile waits on something slow holds a worker for at most that long, and its
    next reconcile looks at its deadlines afresh."""

    async def worker(i: int) -> None:
        while True:
            try:
                key = await queue.get()
            except ShutDown:
                return
            bound = asyncio.timeout(timeout)
            try:
                queue.stats.reconciles += 1
                async with bound:
                    again = await reconcile(key)
            except Exception:
                queue.stats.errors += 1
                delay = queue.add_rate_limited(key)
                if bound.expired():  # this bound, not a TimeoutError of the reconcile's own
                    log.warning("%s %s: not done within %g s, cancelled; again in %.2f s", name, key, timeout, delay)
                else:
                    log.exception("%s %s failed; again in %.2f s", name, key, delay)
            else:
                queue.forget(key)
                if again is not None:
                    queue.add_after(key, again)
            finally:
                queue.done(key)

    await asyncio.gather(*(worker(i) for i in range(workers)))
