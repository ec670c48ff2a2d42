"""Lease leader election, after client-go's ``leaderelection`` (layer: runtime).

``LeaderElector(leases, name)`` makes one of several replicas the leader by holding the
``coordination.k8s.io/v1`` Lease ``name`` through ``dynsnap.k8s.leases.Leases`` (whose identity
is this replica's ``holderIdentity``). ``run()`` goes through three phases:

1. **Acquire.** Every ``retry_period`` (jittered up to 2.2x, as client-go's ``JitterUntil`` with
   factor 1.2, so replicas started together spread out) it reads the Lease and tries to take it.
   A lease held by another replica is taken only once it is expired by *both* clocks: the
   holder's ``renewTime + leaseDurationSeconds`` against our wall clock (``Leases``), and our own
   monotonic time since we last saw the lease record change (client-go's ``observedTime``), so a
   contender whose wall clock runs fast cannot take a lease early. A released lease (no holder)
   is taken at once.
2. **Renew.** Every ``retry_period`` it extends the hold. Leadership is valid until
   ``renew_deadline`` after the start of the last successful renew (``leading`` turns False by
   itself then, even if this loop is stuck). If no renew lands within that deadline (API errors,
   no answer, 409s) leadership is **lost**. It is lost at once, without waiting for the
   deadline, when the Lease shows another holder (or none, or is gone): someone took it. Every
   request is bounded by the time left to the deadline, so an API server that does not answer
   ends in a loss, never in a hang. Because ``renew_deadline < lease_duration``, the old leader
   has declared the loss before any other replica can see the lease expired.
3. **Lost.** ``leading`` turns False, the ``lost`` event is set, the ``on_lost`` callbacks run and
   ``run()`` raises :class:`LeadershipLost`. An elector is single-use: a replica that lost must
   not act again; its process exits and restarts (``dynsnap.runtime.manager``), as controllers
   built on client-go and controller-runtime do.

``release()`` gives the lease up (holder cleared) so a successor takes over at its next retry
instead of waiting out the lease. The owner calls it *after* its own work has stopped: while it
runs, nobody else may act. ``run()`` never releases by itself.

Timing: defaults are client-go's (15 s lease, 10 s renew deadline, 2 s retry period). Durations
are judged by ``clock`` (monotonic seconds; injectable). Every loop waits at least a jittered
``retry_period`` (acquire) or until the deadline (renew) between attempts: none spins.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from dynsnap.k8s.leases import Leases, LeaseState

log = logging.getLogger(__name__)

# client-go's leaderelection JitterFactor: an acquire attempt waits retry_period * (1 + U[0, 1.2)).
JITTER_FACTOR = 1.2


class LeadershipLost(Exception):
    """This replica was the leader and no longer is; it must stop acting at once."""

    def __init__(self, *, lease: str, identity: str, reason: str) -> None:
        super().__init__(f"{identity} lost the leadership of lease {lease}: {reason}")
        self.lease = lease
        self.identity = identity
        self.reason = reason


@dataclass
class ElectorStats:
    """Counters for metrics and tests; they only grow."""

    acquire_attempts: int = 0
    acquisitions: int = 0
    renewals: int = 0
    renew_failures: int = 0  # renew attempts that did not land (an error, no answer, a lost write)
    releases: int = 0
    last_error: str = ""


class LeaderElector:
    """Holds one Lease for one identity while it may lead; see the module docstring."""

    def __init__(
        self,
        leases: Leases,
        name: str,
        *,
        lease_duration: int = 15,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        # client-go's validation: the deadline must pass before the lease can expire for the
        # others, and leave room for at least one jittered retry.
        if retry_period <= 0:
            raise ValueError("retry_period must be positive")
        if not renew_deadline > JITTER_FACTOR * retry_period:
            raise ValueError(f"renew_deadline ({renew_deadline}) must exceed {JITTER_FACTOR} x retry_period "
                             f"({retry_period})")
        if not lease_duration > renew_deadline:
            raise ValueError(f"lease_duration ({lease_duration}) must exceed renew_deadline ({renew_deadline})")
        self.leases = leases
        self.name = name
        self.lease_duration = int(lease_duration)
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.clock = clock
        self.stats = ElectorStats()
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self._rng = rng or random.Random()
        self._leading_event = asyncio.Event()
        self._held = False  # we acquired the lease and have not released it (nor seen it taken)
        self._renewed_at = 0.0  # clock() at the start of the last successful acquire or renew
        self._on_lost: list[Callable[[LeadershipLost], None]] = []
        self._observed: tuple[str | None, str, str] | None = None  # (holder, renewTime, resourceVersion)
        self._observed_at = 0.0
        self._ran = False

    # -- public ------------------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        return self.leases.identity

    @property
    def leading(self) -> bool:
        """True while we hold the lease and the last renew is younger than ``renew_deadline``."""
        return self._leading_event.is_set() and self.clock() < self._renewed_at + self.renew_deadline

    async def wait_leading(self) -> None:
        """Return once this replica leads (at once if it does)."""
        await self._leading_event.wait()

    def on_lost(self, callback: Callable[[LeadershipLost], None]) -> None:
        """Call ``callback(LeadershipLost)`` when leadership is lost (before ``run`` raises it)."""
        self._on_lost.append(callback)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Acquire, then renew until ``stop`` is set (returns; the lease is still held: call
        :meth:`release` once the work has stopped) or leadership is lost (raises
        :class:`LeadershipLost`). Cancellation ends it like ``stop``. Call it once."""
        if self._ran:
            raise RuntimeError("a LeaderElector runs once; a replica that lost its lease must restart")
        self._ran = True
        stop = stop or asyncio.Event()
        if not await self._acquire(stop):
            return
        while not await self._sleep(stop, self.retry_period):
            if not await self._renew(stop):
                return

    async def release(self) -> bool:
        """Give the lease up now (holder cleared) if we hold it; bounded by ``renew_deadline``.
        True if released. Call it only after this replica's work has stopped."""
        was_held, self._held = self._held, False
        self._leading_event.clear()
        if not was_held:
            return False
        try:
            async with asyncio.timeout(self.renew_deadline):
                released = await self.leases.release(self.name)
        except Exception as e:  # best effort: the lease then expires by itself
            log.warning("lease %s: %s could not release it: %s", self.name, self.identity, _describe(e))
            return False
        if released:
            self.stats.releases += 1
            log.info("lease %s: %s released it", self.name, self.identity)
        return released

    # -- phases ------------------------------------------------------------------------------------

    async def _acquire(self, stop: asyncio.Event) -> bool:
        """Try every jittered ``retry_period`` until we hold the lease (True) or ``stop`` (False).
        Unbounded by count on purpose: a standby replica waits for as long as the leader lives."""
        while not stop.is_set():
            self.stats.acquire_attempts += 1
            started = self.clock()
            try:
                async with asyncio.timeout(self.renew_deadline):
                    state = await self._try_acquire()
            except Exception as e:  # every failure waits for the next attempt; it is logged
                self.stats.last_error = _describe(e)
                log.warning("lease %s: %s could not try to acquire it: %s", self.name, self.identity,
                            self.stats.last_error)
                state = None
            if state is not None:
                self._renewed_at = started
                self._held = True
                self.stats.acquisitions += 1
                self._leading_event.set()
                log.info("lease %s: %s is the leader (transitions %d)", self.name, self.identity, state.transitions)
                return True
            delay = self.retry_period * (1.0 + JITTER_FACTOR * self._rng.random())
            if await self._sleep(stop, delay):
                break
        return False

    async def _try_acquire(self) -> LeaseState | None:
        current = await self.leases.get(self.name)
        if current is not None:
            self._observe(current)
            held_by_other = current.holder is not None and current.holder != self.identity
            if held_by_other and self.clock() < self._observed_at + current.duration_seconds:
                return None  # its holder renewed within its duration, as far as we have seen
        return await self.leases.try_acquire(self.name, duration_seconds=self.lease_duration)

    def _observe(self, state: LeaseState) -> None:
        key = (state.holder, str(state.renew_time), state.resource_version)
        if key != self._observed:
            self._observed = key
            self._observed_at = self.clock()

    async def _renew(self, stop: asyncio.Event) -> bool:
        """One renewal, retried within ``renew_deadline`` of the last success. True when renewed,
        False when ``stop`` came first; raises ``LeadershipLost`` otherwise."""
        deadline = self._renewed_at + self.renew_deadline
        last = "no attempt"
        # Bounded by the deadline: every pass either returns, raises, or waits until the next
        # retry or the deadline; the deadline check ends it.
        while True:
            remaining = deadline - self.clock()
            if remaining <= 0:  # the lease may still be ours: release() may give it up
                self._lose(f"could not renew within {self.renew_deadline:g} s ({last})")
            started = self.clock()
            current: LeaseState | None = None
            try:
                async with asyncio.timeout(remaining):
                    state = await self.leases.renew(self.name)
                    if state is None:
                        current = await self.leases.get(self.name)
            except Exception as e:  # TimeoutError (no answer in time), API and transport errors
                last = _describe(e) if not isinstance(e, TimeoutError) else "no answer before the deadline"
            else:
                if state is not None:
                    self._renewed_at = started
                    self.stats.renewals += 1
                    return True
                if current is None:
                    self._lose("the lease was deleted", taken=True)
                if current.holder != self.identity:
                    self._lose(f"the lease is held by {current.holder or 'nobody (released)'}", taken=True)
                last = "a concurrent write to the lease won"  # still ours: our own retried write, say
            self.stats.renew_failures += 1
            self.stats.last_error = last
            log.warning("lease %s: %s could not renew it: %s", self.name, self.identity, last)
            if await self._sleep(stop, min(self.retry_period, max(0.0, deadline - self.clock()))):
                return False

    def _lose(self, reason: str, *, taken: bool = False) -> NoReturn:
        err = LeadershipLost(lease=self.name, identity=self.identity, reason=reason)
        self._leading_event.clear()
        if taken:
            self._held = False  # not ours any more: nothing to release
        self.lost_reason = reason
        self.lost.set()
        log.error("%s", err)
        for callback in list(self._on_lost):
            try:
                callback(err)
            except Exception:  # one observer's bug must not keep the loss from the others
                log.exception("lease %s: on_lost callback %r failed", self.name, callback)
        raise err

    @staticmethod
    async def _sleep(stop: asyncio.Event, delay: float) -> bool:
        """Wait ``delay`` seconds or until ``stop``; True if stopped."""
        if stop.is_set():
            return True
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            return False
        return True


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
