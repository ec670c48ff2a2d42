"""The manager a long-running dynsnap process runs on, after controller-runtime's (layer: runtime).

``Manager(name, informers=[...], health_port=..., metrics=..., elector=...)`` owns the order in
which a controller or an agent comes up and goes down; ``add(name, fn)`` registers runnables
``async fn(stop: asyncio.Event) -> None`` (reconcile workers, periodic loops). ``run(stop)``:

1. serves ``/healthz`` (200 while the event loop answers), ``/readyz`` (200 only when every
   informer has synced, the manager is not stopping, and, with an elector, this replica leads)
   and ``/metrics`` (the ``metrics`` callable's Prometheus text) on ``health_host:health_port``
   (``health_port=None``: no server; 0: any free port, read back from ``port``);
2. starts the informers and waits for their first list (bounded by ``sync_timeout``), so a
   reconcile never reads a half-filled cache;
3. with an elector, waits until this replica leads (``dynsnap.runtime.leader``);
4. starts every runnable and supervises them all until ``stop`` is set.

How it ends:

- ``stop`` set: runnables see their ``stop`` event and get ``shutdown_timeout`` to return, then are
  cancelled; only after they are done is the lease released (so a successor never acts while this
  replica still does), then the informers and the health server stop. ``run`` returns None.
- **Leadership lost**: every runnable is cancelled at once, in the same step the elector declares
  the loss (an ``on_lost`` callback), then ``run`` raises :class:`LeadershipLost`. The process
  must then exit non-zero so its Deployment restarts it as a fresh candidate: controller-runtime
  does the same (its manager returns "leader election lost" and the binary exits), because a
  process that was cut off mid-reconcile must not resume from in-memory state that another
  leader may since have invalidated.
- An informer that dies (``InformerFailed``, past its failure budget), a runnable that raises, or
  the first sync timing out: every runnable is cancelled at once and ``run`` raises that error.
  A runnable that returns normally before ``stop`` has just finished; the others carry on.

Every wait is bounded (``sync_timeout``, ``shutdown_timeout``) or ended by ``stop``; the
supervision loop wakes only when a task ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from dynsnap.runtime.health import HealthServer
from dynsnap.runtime.leader import LeaderElector, LeadershipLost

__all__ = ["InformerLike", "LeadershipLost", "Manager", "Runnable", "run_until_stopped"]

log = logging.getLogger(__name__)

Runnable = Callable[[asyncio.Event], Awaitable[None]]


class InformerLike(Protocol):
    """What the manager needs of an informer (``dynsnap.k8s.informer.Informer`` is one)."""

    name: str

    @property
    def synced(self) -> bool: ...

    def start(self) -> asyncio.Task[None]: ...

    async def wait_synced(self, timeout: float) -> None: ...

    async def stop(self) -> None: ...


class Manager:
    """Informers, an optional leader elector, runnables and a health endpoint, in order."""

    def __init__(
        self,
        name: str,
        *,
        informers: Sequence[InformerLike] = (),
        health_host: str = "0.0.0.0",
        health_port: int | None = None,
        metrics: Callable[[], str] | None = None,
        elector: LeaderElector | None = None,
        # An informer's first list of 10,000 pods is 20 pages; two minutes also covers an API
        # server that is briefly unavailable at start (the informer retries within it).
        sync_timeout: float = 120.0,
        # controller-runtime's GracefulShutdownTimeout default; well within a pod's default
        # 30 s terminationGracePeriodSeconds only if runnables return promptly on ``stop``.
        shutdown_timeout: float = 30.0,
    ) -> None:
        self.name = name
        self.informers = list(informers)
        self.elector = elector
        self.metrics = metrics
        self.sync_timeout = sync_timeout
        self.shutdown_timeout = shutdown_timeout
        self.health = HealthServer(host=health_host, port=health_port, ready=lambda: self.ready,
                                   metrics=metrics) if health_port is not None else None
        self.port: int | None = None  # the health server's port once it listens
        self.phase = "new"  # syncing -> electing -> running -> stopping -> stopped
        self._runnables: list[tuple[str, Runnable]] = []
        self._watched: dict[asyncio.Task[Any], str] = {}  # tasks whose end ends run(): what each is
        self._runnable_tasks: list[asyncio.Task[None]] = []
        self._elector_task: asyncio.Task[None] | None = None
        self._elector_stop = asyncio.Event()
        self._runnables_stop = asyncio.Event()  # what runnables see as ``stop``
        self._cancelled_runnables = False

    def add(self, name: str, fn: Runnable) -> None:
        """Run ``fn(stop)`` once the manager may act (synced and, with an elector, leading)."""
        if self.phase != "new":
            raise RuntimeError("add runnables before run()")
        self._runnables.append((name, fn))

    @property
    def synced(self) -> bool:
        return all(inf.synced for inf in self.informers)

    @property
    def ready(self) -> bool:
        """What ``/readyz`` says: synced, not stopping, and leading when there is an election."""
        return (self.phase in ("electing", "running") and self.synced
                and (self.elector is None or self.elector.leading))

    async def run(self, stop: asyncio.Event) -> None:
        """Bring everything up, run until ``stop``, bring everything down; see the module docstring."""
        if self.phase != "new":
            raise RuntimeError("a Manager runs once")
        self.phase = "starting"
        graceful = False
        try:
            if self.health is not None:
                self.port = await self.health.start()
            for inf in self.informers:
                self._watched[inf.start()] = f"informer {inf.name}"
            self.phase = "syncing"
            if not await self._until(self._first_sync(), stop):
                graceful = True
                return
            if self.elector is not None:
                self.phase = "electing"
                self.elector.on_lost(lambda _: self._cancel_runnables())
                self._elector_task = asyncio.create_task(self.elector.run(self._elector_stop),
                                                         name=f"{self.name} leader election")
                self._watched[self._elector_task] = "leader election"
                if not await self._until(self.elector.wait_leading(), stop):
                    graceful = True
                    return
            self.phase = "running"
            log.info("%s: running %s", self.name, ", ".join(n for n, _ in self._runnables) or "nothing")
            for name, fn in self._runnables:
                task = asyncio.create_task(self._call(fn), name=f"{self.name} {name}")
                self._runnable_tasks.append(task)
                self._watched[task] = f"runnable {name}"
            await self._until(None, stop)
            graceful = True
        finally:
            await self._shutdown(graceful=graceful)

    # -- supervision -------------------------------------------------------------------------------

    async def _call(self, fn: Runnable) -> None:
        await fn(self._runnables_stop)

    async def _first_sync(self) -> None:
        await asyncio.gather(*(inf.wait_synced(self.sync_timeout) for inf in self.informers))
        log.info("%s: %d informers synced", self.name, len(self.informers))

    async def _until(self, aw: Awaitable[None] | None, stop: asyncio.Event) -> bool:
        """Wait until ``aw`` completes (True) or ``stop`` is set (False). A watched task that ends
        first raises its error here (or ``LeadershipLost``); a runnable that returns is let go."""
        waiter = asyncio.ensure_future(aw) if aw is not None else None
        stopper = asyncio.ensure_future(stop.wait())
        try:
            # Each pass ends a watched task's supervision, or returns: at most len(watched) + 1 passes.
            while True:
                pending: set[asyncio.Future[Any]] = {stopper, *self._watched}
                if waiter is not None:
                    pending.add(waiter)
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # Errors first: a loss cancels the runnables in the step it raises, so both end together.
                ended = sorted((t for t in done if t in self._watched), key=lambda t: t.cancelled())
                for task in ended:
                    self._ended(task)  # raises unless a runnable finished (or we cancelled it)
                if stopper in done:
                    return False
                if waiter is not None and waiter in done:
                    waiter.result()  # its error, if any
                    return True
        finally:
            await _cancel_quietly(waiter, stopper)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        what = self._watched.pop(task)
        if task.cancelled():
            if self._cancelled_runnables and what.startswith("runnable "):
                return  # by us, on a loss: the elector's task says why
            raise RuntimeError(f"{self.name}: {what} was cancelled")
        exc = task.exception()
        if exc is not None:
            log.error("%s: %s ended with %s: %s", self.name, what, type(exc).__name__, exc)
            raise exc
        if what.startswith("runnable "):
            log.info("%s: %s finished", self.name, what)
            return
        raise RuntimeError(f"{self.name}: {what} stopped by itself")

    def _cancel_runnables(self) -> None:
        # Cancel only: setting their ``stop`` in the same step could let a runnable that was
        # waiting on it return normally instead (3.11's wait_for prefers a result to a cancel).
        self._cancelled_runnables = True
        for t in self._runnable_tasks:
            t.cancel()

    async def _shutdown(self, *, graceful: bool) -> None:
        self.phase = "stopping"
        if not graceful:
            self._cancel_runnables()
        self._runnables_stop.set()
        tasks = [t for t in self._runnable_tasks if not t.done()]
        if graceful and tasks:
            _, late = await asyncio.wait(tasks, timeout=self.shutdown_timeout)
            if late:
                log.warning("%s: %d runnables did not return within %.0f s of stop; cancelling them",
                            self.name, len(late), self.shutdown_timeout)
        await _cancel_all(self._runnable_tasks, self.shutdown_timeout, what=f"{self.name} runnables")
        if self._elector_task is not None:
            self._elector_stop.set()
            await _cancel_all([self._elector_task], self.shutdown_timeout, what=f"{self.name} leader election")
        if self.elector is not None:
            await self.elector.release()  # only now: nothing of ours acts any more
        for inf in self.informers:
            with contextlib.suppress(Exception):
                await inf.stop()
        if self.health is not None:
            await self.health.stop()
        self.phase = "stopped"
        log.info("%s: stopped", self.name)


async def _cancel_all(tasks: Sequence[asyncio.Task[Any]], timeout: float, *, what: str) -> None:
    """Cancel ``tasks`` and wait (bounded) for them to end; their outcomes were seen already."""
    live = [t for t in tasks if not t.done()]
    for t in live:
        t.cancel()
    if live:
        _, stuck = await asyncio.wait(live, timeout=timeout)
        if stuck:
            log.error("%s: %d tasks ignored cancellation for %.0f s", what, len(stuck), timeout)
    for t in tasks:  # retrieve outcomes so asyncio does not log "exception never retrieved"
        if t.done() and not t.cancelled():
            t.exception()


async def run_until_stopped(aw: Awaitable[None], stop: asyncio.Event, *,
                            on_stop: Callable[[], None] | None = None) -> None:
    """Await ``aw`` until it ends (its error propagates) or ``stop`` is set (``on_stop`` is called,
    then it is cancelled and waited for); a runnable built on a loop that knows nothing of ``stop``
    uses this. ``on_stop`` is for a loop that must end even where a cancellation goes missing: a
    work queue's shutdown, so that a worker whose cancellation was swallowed (Python 3.11's
    ``asyncio.wait_for`` can lose one that lands as its inner call completes) ends at its next
    ``get`` instead of going on reconciling after the client it writes through is closed."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        elif on_stop is not None:
            on_stop()
    finally:
        await _cancel_quietly(task, stopper)


async def _cancel_quietly(*futures: asyncio.Future[Any] | None) -> None:
    """Cancel what is still pending and wait until it ended. ``asyncio.wait`` does not raise the
    futures' own cancellation, so only a cancellation of the caller propagates."""
    live = [f for f in futures if f is not None and not f.done()]
    for f in live:
        f.cancel()
    if live:
        await asyncio.wait(live)
    for fut in futures:
        if fut is not None and fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: an error we did not raise was superseded by what we raise
