"""A work queue of keys for level-triggered reconcilers, after controller-runtime's:

- a key waiting in the queue is there once, however often it is added (dedupe);
- a key being processed is never handed to a second worker; adding it meanwhile marks it dirty
  and it comes back once the first worker is done;
- ``add_after`` schedules a key for later (the reconcile's "look again after T");
- ``add_rate_limited`` backs off per key (doubling from ``base`` to ``cap``) until ``forget``;
- fair between groups (``group_of``: a controller's graph of a key): the waiting keys of each group are
  handed out in turn, one group after another, and with ``group_limit`` no group has more than that many
  keys processed at once, so the workers one group's slow reconciles hold are at most its share.

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
from collections import deque
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
    # Fair share: the group of a key (None: one group), and the most keys of one group processed at once
    # (0: no limit). A group's keys wait in its own line; the lines are served in turn.
    group_of: Callable[[K], str] | None = None
    group_limit: int = 0
    _lines: dict[str, deque[K]] = field(default_factory=dict)
    _turns: deque[str] = field(default_factory=deque)  # the groups with a key waiting, in the order served
    _active: dict[str, int] = field(default_factory=dict)  # group -> its keys being processed
    _group: dict[K, str] = field(default_factory=dict)  # a key processed -> the group it was counted in
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
        return len(self._queued)

    @property
    def depth(self) -> int:
        """Keys waiting now (not counting those scheduled for later or being processed)."""
        return len(self._queued)

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
        g = self.group_of(key) if self.group_of is not None else ""
        line = self._lines.get(g)
        if line is None:
            line = self._lines[g] = deque()
            self._turns.append(g)
        line.append(key)
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
            key = self._next()
            if key is not None:
                return key
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait if wait is not None else 3600.0)

    def _next(self) -> K | None:
        """The first waiting key of the first group in turn that is under its limit; that group goes to the
        back of the turns (None: nothing waiting, or every group with a key at its limit)."""
        for _ in range(len(self._turns)):
            g = self._turns[0]
            self._turns.rotate(-1)
            if self.group_limit and self._active.get(g, 0) >= self.group_limit:
                continue
            line = self._lines[g]
            key = line.popleft()
            if not line:
                del self._lines[g]
                self._turns.remove(g)
            self._queued.discard(key)
            self._processing.add(key)
            self._group[key] = g
            self._active[g] = self._active.get(g, 0) + 1
            return key
        return None

    def done(self, key: K) -> None:
        self._processing.discard(key)
        g = self._group.pop(key, None)
        if g is not None:
            n = self._active.get(g, 0) - 1
            if n > 0:
                self._active[g] = n
            else:
                self._active.pop(g, None)
            self._wakeup.set()  # a group at its limit may be served again
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
