"""List-then-watch into an indexed store, for processes that live for months (layer: k8s).

``Informer(kube, res, indexers=...)`` keeps ``informer.store`` (``dynsnap.k8s.store``) level with the
API server and hands every change, as ``(event type, object)``, to registered handlers (sync or
async callables; the controller and the agent enqueue keys from them):

1. **List**, paginated (``limit`` + ``continue``). A 410 on a continue token (the snapshot it pins
   was compacted) restarts the list from the first page, at most ``list_restarts`` times.
   The store is replaced as a whole: objects missing from the list are delivered as DELETED with
   their last known state (synthetic deletes), so nothing deleted while the informer was blind
   lingers. ``wait_synced()`` returns once the first list is in the store.
2. **Watch** from the list's resourceVersion with bookmarks. When the server ends a stream
   normally (its ``timeoutSeconds``) the next watch resumes from the last resourceVersion seen,
   event or bookmark, with no relist. 410 Gone means that point was compacted: relist.
3. **Reconnect** after every failure, of any class (429 honouring Retry-After, 5xx, 403 while RBAC
   is being fixed, refused or reset connections, a stream silent past ``silent_deadline``, a
   garbled line), with jittered exponential backoff. The informer gives up, raising
   ``InformerFailed`` to its owner, only when more than ``max_failures`` consecutive failures fall
   within ``failure_window`` seconds with no successful list or watch between them: a rate bound,
   not a lifetime count, so one failure an hour is retried forever.

List pages are not retried by ``dynsnap.k8s.retry``: this loop is the one retry mechanism here,
so its backoff and bound are the whole story. Its sleeps obey the instant switch of that module.
Handlers run one at a time on the informer's task; one that raises is logged and counted and
does not stop the informer. Listed items get ``apiVersion``/``kind`` filled in (the API server
omits them in lists), so every object in the store names its type. ``transform`` (client-go's
``TransformFunc``), when given, is applied to every listed and watched object before it is stored
or delivered: what the owner never reads need not be kept for months (:func:`strip_managed_fields`:
``metadata.managedFields`` is about half of a pod).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from dynsnap.k8s import retry
from dynsnap.k8s.backoff import Backoff, FailureBudget
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Gone, InformerFailed, K8sError, WatchSilent
from dynsnap.k8s.store import ADDED, DELETED, MODIFIED, IndexFunc, Store
from dynsnap.models.resources import Resource

log = logging.getLogger(__name__)

BOOKMARK: Final = "BOOKMARK"

Handler = Callable[[str, Obj], Awaitable[None] | None]
Transform = Callable[[Obj], Obj]


def strip_managed_fields(obj: Obj) -> Obj:
    """``obj`` without ``metadata.managedFields`` (server-side apply's bookkeeping: about half of a pod's
    and of a WorkerSnapshot's bytes, and nothing a controller reads). Edits the object it is given,
    which is the informer's own freshly decoded copy."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj

# A list never needs more pages than this: 10,000 pods are 20 pages of 500. Hitting it means the
# server keeps handing out continue tokens, a bug this loop must not spin on.
MAX_PAGES = 10_000


@dataclass(frozen=True, kw_only=True)
class InformerSettings:
    # client-go's pager default: 10,000 pods are 20 requests, and no single page makes the API
    # server (or us) hold a huge response in memory.
    page_size: int = 500
    # The server ends each watch after this many seconds, times a random 1-1.5 so that agents
    # on every node, started together, do not reconnect together. client-go's reflector picks
    # 5-10 min. Each end costs one cheap re-watch from the last resourceVersion.
    watch_timeout_seconds: int = 300
    # A stream with no byte for this long is dead (a half-open TCP connection after a node or
    # load-balancer failure never errors by itself). It must exceed the longest healthy silence:
    # resources without a watch cache get no bookmarks, so an idle stream is silent until the
    # server ends it, after at most 1.5 x watch_timeout_seconds = 450 s; plus a 30 s margin.
    # Cached resources get a bookmark a minute, so an owner watching only those may go lower.
    silent_deadline: float = 480.0
    # client-go's reflector backs off 800 ms -> 30 s: the first retry lands after a blip is
    # over, and thousands of agents facing a recovering API server ask at most twice a minute.
    backoff: Backoff = field(default_factory=lambda: Backoff(base=0.8, cap=30.0))
    # Give up after more than 10 consecutive failures within 300 s with no success between:
    # with the backoff above, about 2.5 minutes of an unusable API server. The owner exits and
    # its restart (and alerting) makes the outage visible instead of serving a stale cache.
    max_failures: int = 10
    failure_window: float = 300.0
    # A 410 on a continue token means the snapshot went while we paged; restarting is cheap,
    # but a cluster compacting faster than we can page needs the backoff loop, not a spin.
    list_restarts: int = 3


@dataclass
class InformerStats:
    """Counters for metrics and tests; they only grow (except ``consecutive_failures``)."""

    list_requests: int = 0  # pages requested, including failed ones
    lists: int = 0  # complete lists applied to the store
    list_restarts: int = 0  # 410 on a continue token
    relists_after_gone: int = 0  # 410 on a watch
    watches: int = 0  # watch streams opened
    watch_events: int = 0  # ADDED/MODIFIED/DELETED from watches
    bookmarks: int = 0
    synthetic_deletes: int = 0
    silent_streams: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    handler_errors: int = 0
    delays: deque[float] = field(default_factory=lambda: deque(maxlen=64))  # backoff chosen, newest last
    last_error: str = ""


class Informer:
    """One resource (optionally a namespace and selectors) mirrored into ``store``."""

    def __init__(
        self,
        kube: Kube,
        res: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        indexers: Mapping[str, IndexFunc] | None = None,
        settings: InformerSettings | None = None,
        name: str | None = None,
        transform: Transform | None = None,
    ) -> None:
        self.kube = kube
        self.res = res
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.settings = settings or InformerSettings()
        self.transform = transform
        self.name = name or "/".join(p for p in (res.plural, namespace, label_selector, field_selector) if p)
        self.store = Store(indexers)
        self.stats = InformerStats()
        # Where the next watch resumes; None: list first. Set before start() to resume from a
        # point saved earlier: if that point was compacted, the 410 leads to a relist.
        self.resource_version: str | None = None
        self._handlers: list[Handler] = []
        self._synced = asyncio.Event()
        self._done = asyncio.Event()
        self._failure: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._gone_streak = 0
        self._skipped = 0.0  # seconds instant mode did not sleep: the failure window still counts them
        self._budget = FailureBudget(max_failures=self.settings.max_failures, window=self.settings.failure_window,
                                     clock=lambda: time.monotonic() + self._skipped)
        self._rng = random.Random()

    # -- public ------------------------------------------------------------------------------------

    def add_handler(self, handler: Handler) -> None:
        """Deliver every later change to ``handler(event_type, obj)``; add handlers before ``start``
        to see the first list's ADDED events."""
        self._handlers.append(handler)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def failure(self) -> BaseException | None:
        """Why ``run`` ended, if it ended by itself."""
        return self._failure

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"informer {self.name}")
        return self._task

    async def stop(self) -> None:
        """Cancel the informer and wait for it; an ``InformerFailed`` it ended with stays in ``failure``."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # our caller is being cancelled too: pass it on
                raise
        except InformerFailed:
            pass

    async def __aenter__(self) -> Informer:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_synced(self, timeout: float) -> None:
        """Return once the first full list is in the store; raise the informer's failure if it died
        first, ``TimeoutError`` after ``timeout`` seconds."""
        if self._synced.is_set():
            return
        waiters = [asyncio.ensure_future(self._synced.wait()), asyncio.ensure_future(self._done.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        if self._synced.is_set():
            return
        if self._failure is not None:
            raise self._failure
        if self._done.is_set():
            raise K8sError(f"informer {self.name} stopped before its first list")
        raise TimeoutError(f"informer {self.name} not synced after {timeout:.0f}s "
                           f"({self.stats.failures} failures; last: {self.stats.last_error or 'none'})")

    async def run(self) -> None:
        """List, watch and reconnect until cancelled; raises ``InformerFailed`` past the rate bound."""
        try:
            await self._loop()
        except InformerFailed as e:
            self._failure = e
            raise
        finally:
            self._done.set()

    # -- the loop ----------------------------------------------------------------------------------

    async def _loop(self) -> None:
        # Unbounded by count on purpose: a healthy informer re-watches every few minutes for as
        # long as the process lives. Failures are bounded by the budget (InformerFailed); a
        # normal stream end that comes too fast counts as a failure, so nothing spins.
        while True:
            try:
                if self.resource_version is None:
                    self.resource_version = await self._list()
                    self._success()
                if not await self._watch():
                    raise K8sError("watch stream ended at once, without an event")
            except Gone as e:
                # The resume point was compacted away: relist. Once is the protocol; Gone again
                # before the new watch saw anything is a failure and backs off.
                self.resource_version = None
                self.stats.relists_after_gone += 1
                self._gone_streak += 1
                log.info("informer %s: %s; relisting", self.name, e.message)
                if self._gone_streak > 1:
                    await self._failed(e)
            except WatchSilent as e:
                self.stats.silent_streams += 1
                await self._failed(e)
            except Exception as e:  # every class reconnects; the budget decides when to stop
                await self._failed(e)

    def _success(self) -> None:
        self._budget.success()
        self.stats.consecutive_failures = 0

    async def _failed(self, exc: BaseException) -> None:
        self.stats.failures += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        n = self._budget.failure()
        self.stats.consecutive_failures = n
        if self._budget.exhausted:
            log.error("informer %s: giving up after %d consecutive failures in %.0fs: %s",
                      self.name, n, self.settings.failure_window, self.stats.last_error)
            raise InformerFailed(self.name, failures=n, window=self.settings.failure_window, last=exc) from exc
        delay = self.settings.backoff.delay(n, retry_after=retry.retry_after_of(exc), rng=self._rng)
        self.stats.delays.append(delay)
        log.warning("informer %s: %s (failure %d); reconnecting in %.2fs", self.name, self.stats.last_error, n, delay)
        self._skipped += await retry.sleep(delay)

    async def _list(self) -> str:
        items: list[Obj] = []
        rv: str | None = None
        for restart in range(self.settings.list_restarts + 1):
            items, rv, token = [], None, None
            try:
                for _ in range(MAX_PAGES):
                    self.stats.list_requests += 1
                    page = await self.kube.list(self.res, namespace=self.namespace, label_selector=self.label_selector,
                                                field_selector=self.field_selector, limit=self.settings.page_size,
                                                continue_token=token, retry=False)
                    items.extend(page.get("items") or [])
                    meta = page.get("metadata") or {}
                    rv = meta.get("resourceVersion")
                    token = meta.get("continue") or None
                    if token is None:
                        break
                else:
                    raise K8sError(f"list of {self.name} still had a continue token after {MAX_PAGES} pages")
                break
            except Gone:
                if token is None or restart == self.settings.list_restarts:
                    raise
                self.stats.list_restarts += 1
                log.info("informer %s: continue token expired after %d items; restarting the list",
                         self.name, len(items))
        if not rv:
            raise K8sError(f"list of {self.name} came back without a resourceVersion")
        for item in items:
            item.setdefault("apiVersion", self.res.api_version)
            item.setdefault("kind", self.res.kind)
        if self.transform is not None:
            items = [self.transform(item) for item in items]
        events = self.store.replace(items)
        self.stats.lists += 1
        if self._synced.is_set():
            self.stats.synthetic_deletes += sum(1 for typ, _ in events if typ == DELETED)
        for typ, obj in events:
            await self._deliver(typ, obj)
        # Synced only after the handlers saw the first list: a controller that starts its workers
        # on wait_synced() finds every key already queued.
        self._synced.set()
        return str(rv)

    async def _watch(self) -> bool:
        """One watch stream; True when it was healthy (saw something, or lasted) and ended normally."""
        t = self.settings.watch_timeout_seconds
        timeout = self._rng.randint(t, max(t, int(t * 1.5)))
        self.stats.watches += 1
        started = time.monotonic()
        seen = 0
        async for ev in self.kube.watch(self.res, namespace=self.namespace, label_selector=self.label_selector,
                                        field_selector=self.field_selector, resource_version=self.resource_version,
                                        bookmarks=True, timeout_seconds=timeout,
                                        silent_deadline=self.settings.silent_deadline):
            seen += 1
            self._success()
            self._gone_streak = 0
            typ, obj = ev.get("type"), ev.get("object") or {}
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if self.transform is not None and typ in (ADDED, MODIFIED, DELETED):
                obj = self.transform(obj)
            if typ == BOOKMARK:
                self.stats.bookmarks += 1
            elif typ in (ADDED, MODIFIED):
                self.store.upsert(obj)
                self.stats.watch_events += 1
                await self._deliver(str(typ), obj)
            elif typ == DELETED:
                self.store.remove(obj)
                self.stats.watch_events += 1
                await self._deliver(DELETED, obj)
            else:
                log.warning("informer %s: ignoring watch event of type %r", self.name, typ)
            if rv:
                self.resource_version = str(rv)
        healthy = seen > 0 or time.monotonic() - started >= min(1.0, timeout / 2)
        if healthy:
            self._success()
        return healthy

    async def _deliver(self, typ: str, obj: Obj) -> None:
        for handler in list(self._handlers):
            try:
                result = handler(typ, obj)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # one consumer's bug must not blind the others or stop the informer
                self.stats.handler_errors += 1
                log.exception("informer %s: handler %r failed on %s", self.name, handler, typ)
