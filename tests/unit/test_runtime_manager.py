"""The manager's ordering and supervision: nothing runs before every informer's first list,
``/readyz`` follows the sync, a runnable's error or an informer's death ends ``run`` with that
error and cancels the rest, ``stop`` brings everything down in order and leaves no task behind.

Pure machinery, so the informers here are stubs the test drives (``StubInformer``); leader
election runs against the real API server in tests/integration/test_leader.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from dynsnap.k8s.errors import InformerFailed
from dynsnap.runtime.manager import Manager, run_until_stopped
from dynsnap.runtime.workqueue import WorkQueue, run_workers

BOUND = 10.0  # every wait in these tests gives up after this many seconds


class StubInformer:
    """Stands in for ``dynsnap.k8s.informer.Informer``, reduced to what the manager uses of one
    (start, first sync, dying, stop); the test decides when it syncs or dies. Every step it
    takes is appended to the shared ``journal``."""

    def __init__(self, name: str, journal: list[str]) -> None:
        self.name = name
        self.journal = journal
        self._synced = asyncio.Event()
        self._dead = asyncio.Event()
        self._failure: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def sync(self) -> None:
        self.journal.append(f"synced {self.name}")
        self._synced.set()

    def die(self, exc: BaseException) -> None:
        self._failure = exc
        self._dead.set()

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self.journal.append(f"started {self.name}")
            self._task = asyncio.create_task(self._run())
        return self._task

    async def _run(self) -> None:
        await self._dead.wait()
        assert self._failure is not None
        raise self._failure

    async def wait_synced(self, timeout: float) -> None:
        waits = [asyncio.ensure_future(self._synced.wait()), asyncio.ensure_future(self._dead.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if self.synced:
            return
        if self._failure is not None:
            raise self._failure
        raise TimeoutError(f"informer {self.name} not synced after {timeout:.0f}s")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.journal.append(f"stopped {self.name}")


def stub_runnable(name: str, journal: list[str], *, started: asyncio.Event | None = None,
                  fail: BaseException | None = None, ignore_stop: bool = False
                  ) -> Callable[[asyncio.Event], Awaitable[None]]:
    """A runnable that records starting, then returns on ``stop`` (or raises ``fail``, or waits
    on regardless of ``stop`` until cancelled), recording how it ended."""

    async def run(stop: asyncio.Event) -> None:
        journal.append(f"runnable {name} started")
        if started is not None:
            started.set()
        try:
            if fail is not None:
                await asyncio.sleep(0)
                raise fail
            if ignore_stop:
                await asyncio.Event().wait()
            await stop.wait()
            journal.append(f"runnable {name} returned")
        except asyncio.CancelledError:
            journal.append(f"runnable {name} cancelled")
            raise
    return run


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), BOUND)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), BOUND)
    finally:
        writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


async def wait_until(what: str, check: Callable[[], bool]) -> None:
    """Yield to the loop until ``check()``; bounded by count and by ``BOUND`` seconds."""
    async with asyncio.timeout(BOUND):
        for _ in range(100_000):
            if check():
                return
            await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    before = asyncio.all_tasks()
    yield
    leaked = [t for t in asyncio.all_tasks() - before - {asyncio.current_task()} if not t.done()]
    assert leaked == [], f"tasks left running: {leaked}"


async def test_no_runnable_starts_before_every_informer_synced(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    a, b = StubInformer("a", journal), StubInformer("b", journal)
    started = asyncio.Event()
    m = Manager("test", informers=[a, b])
    m.add("work", stub_runnable("work", journal, started=started))
    stop = asyncio.Event()
    run = asyncio.create_task(m.run(stop))
    await wait_until("the manager waits for the first sync", lambda: m.phase == "syncing")
    a.sync()
    for _ in range(50):  # many turns of the loop: the runnable still must not start
        await asyncio.sleep(0)
    assert not started.is_set() and m.phase == "syncing" and not m.ready
    b.sync()
    await asyncio.wait_for(started.wait(), BOUND)
    assert m.phase == "running" and m.ready
    stop.set()
    assert await asyncio.wait_for(run, BOUND) is None
    assert journal.index("runnable work started") > max(journal.index("synced a"), journal.index("synced b"))
    assert journal[-3:] == ["runnable work returned", "stopped a", "stopped b"]
    assert m.phase == "stopped"


async def test_health_endpoints_follow_the_sync_and_serve_metrics(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    inf = StubInformer("pods", journal)
    m = Manager("test", informers=[inf], health_host="127.0.0.1", health_port=0,
                metrics=lambda: "# TYPE stub_metric gauge\nstub_metric 7\n")
    stop = asyncio.Event()
    run = asyncio.create_task(m.run(stop))
    await wait_until("the manager syncs", lambda: m.phase == "syncing")
    assert m.port is not None and m.port > 0
    assert await http_get(m.port, "/healthz") == (200, "ok\n")
    assert await http_get(m.port, "/readyz") == (503, "not ready\n")
    assert await http_get(m.port, "/metrics") == (200, "# TYPE stub_metric gauge\nstub_metric 7\n")
    inf.sync()
    await wait_until("the manager runs", lambda: m.phase == "running")
    assert await http_get(m.port, "/readyz") == (200, "ready\n")
    stop.set()
    await asyncio.wait_for(run, BOUND)
    with pytest.raises(ConnectionRefusedError):  # the server went down with the manager
        await http_get(m.port, "/healthz")


async def test_a_runnable_that_raises_ends_run_with_its_error_and_cancels_the_others(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    inf = StubInformer("pods", journal)
    inf.sync()
    other_started = asyncio.Event()
    m = Manager("test", informers=[inf])
    m.add("steady", stub_runnable("steady", journal, started=other_started))
    m.add("broken", stub_runnable("broken", journal, fail=ValueError("reconcile loop broke: bad key")))
    with pytest.raises(ValueError, match="reconcile loop broke: bad key"):
        await asyncio.wait_for(m.run(asyncio.Event()), BOUND)
    # The other runnable was cancelled (not asked to return: this is no graceful stop), then the
    # informer stopped.
    assert "runnable steady cancelled" in journal and "runnable steady returned" not in journal
    assert journal.index("runnable steady cancelled") < journal.index("stopped pods")
    assert m.phase == "stopped" and not m.ready


async def test_an_informer_that_dies_ends_run_with_its_failure(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    inf = StubInformer("workersnapshots", journal)
    inf.sync()
    started = asyncio.Event()
    m = Manager("test", informers=[inf])
    m.add("work", stub_runnable("work", journal, started=started))
    run = asyncio.create_task(m.run(asyncio.Event()))
    await asyncio.wait_for(started.wait(), BOUND)
    inf.die(InformerFailed("workersnapshots", failures=11, window=300.0, last=ConnectionRefusedError("refused")))
    with pytest.raises(InformerFailed, match="workersnapshots"):
        await asyncio.wait_for(run, BOUND)
    assert "runnable work cancelled" in journal


async def test_an_informer_that_dies_before_its_first_list_ends_run_and_nothing_starts(
        no_leaked_tasks: None) -> None:
    journal: list[str] = []
    inf = StubInformer("pods", journal)
    m = Manager("test", informers=[inf])
    m.add("work", stub_runnable("work", journal))
    run = asyncio.create_task(m.run(asyncio.Event()))
    await wait_until("the manager syncs", lambda: m.phase == "syncing")
    inf.die(InformerFailed("pods", failures=11, window=300.0, last=PermissionError("403")))
    with pytest.raises(InformerFailed, match="pods"):
        await asyncio.wait_for(run, BOUND)
    assert not any(e.startswith("runnable") for e in journal)


async def test_the_first_sync_is_bounded(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    m = Manager("test", informers=[StubInformer("never", journal)], sync_timeout=0.05)
    m.add("work", stub_runnable("work", journal))
    with pytest.raises(TimeoutError, match="informer never not synced"):
        await asyncio.wait_for(m.run(asyncio.Event()), BOUND)
    assert not any(e.startswith("runnable") for e in journal) and journal[-1] == "stopped never"


async def test_stop_while_syncing_returns_cleanly_without_running_anything(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    inf = StubInformer("pods", journal)
    m = Manager("test", informers=[inf])
    m.add("work", stub_runnable("work", journal))
    stop = asyncio.Event()
    run = asyncio.create_task(m.run(stop))
    await wait_until("the manager syncs", lambda: m.phase == "syncing")
    stop.set()
    assert await asyncio.wait_for(run, BOUND) is None
    assert journal == ["started pods", "stopped pods"]


async def test_stop_waits_for_runnables_then_cancels_one_that_ignores_it(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    inf = StubInformer("pods", journal)
    inf.sync()
    polite, stubborn = asyncio.Event(), asyncio.Event()
    m = Manager("test", informers=[inf], shutdown_timeout=0.2)
    m.add("polite", stub_runnable("polite", journal, started=polite))
    m.add("stubborn", stub_runnable("stubborn", journal, started=stubborn, ignore_stop=True))
    stop = asyncio.Event()
    run = asyncio.create_task(m.run(stop))
    await asyncio.wait_for(asyncio.gather(polite.wait(), stubborn.wait()), BOUND)
    stop.set()
    assert await asyncio.wait_for(run, BOUND) is None
    assert "runnable polite returned" in journal and "runnable stubborn cancelled" in journal
    # Everything of the manager's own stops only after its runnables are done.
    assert journal.index("runnable stubborn cancelled") < journal.index("stopped pods")


async def test_a_runnable_that_finishes_early_is_not_an_error(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    inf = StubInformer("pods", journal)
    inf.sync()
    done_once = asyncio.Event()
    steady = asyncio.Event()

    async def one_shot(stop: asyncio.Event) -> None:
        done_once.set()

    m = Manager("test", informers=[inf])
    m.add("one-shot", one_shot)
    m.add("steady", stub_runnable("steady", journal, started=steady))
    stop = asyncio.Event()
    run = asyncio.create_task(m.run(stop))
    await asyncio.wait_for(asyncio.gather(done_once.wait(), steady.wait()), BOUND)
    for _ in range(20):
        await asyncio.sleep(0)
    assert not run.done() and m.phase == "running"
    stop.set()
    assert await asyncio.wait_for(run, BOUND) is None
    assert "runnable steady returned" in journal


async def test_a_manager_runs_once_and_takes_runnables_only_before(no_leaked_tasks: None) -> None:
    m = Manager("test")
    stop = asyncio.Event()
    stop.set()
    await asyncio.wait_for(m.run(stop), BOUND)
    with pytest.raises(RuntimeError, match="runs once"):
        await m.run(stop)
    with pytest.raises(RuntimeError, match="before run"):
        m.add("late", stub_runnable("late", []))


async def test_run_until_stopped_cancels_on_stop_and_passes_errors_on(no_leaked_tasks: None) -> None:
    journal: list[str] = []
    stop = asyncio.Event()
    started = asyncio.Event()

    async def endless() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            journal.append("endless cancelled")
            raise

    run = asyncio.create_task(run_until_stopped(endless(), stop))
    await asyncio.wait_for(started.wait(), BOUND)
    stop.set()
    assert await asyncio.wait_for(run, BOUND) is None
    assert journal == ["endless cancelled"]

    async def broken() -> None:
        raise KeyError("no such worker")

    with pytest.raises(KeyError, match="no such worker"):
        await asyncio.wait_for(run_until_stopped(broken(), asyncio.Event()), BOUND)


async def test_run_until_stopped_ends_a_worker_whose_cancellation_went_missing(no_leaked_tasks: None) -> None:
    """A reconcile that swallows its cancellation (as Python 3.11's asyncio.wait_for can when the call it
    waits on completes in the same step) finishes, and its worker then ends at the queue's shutdown
    (``on_stop``) instead of taking the next key: nothing reconciles after run_until_stopped returned.
    Without ``on_stop`` the worker waits in ``get`` and the call never returns (the BOUND here)."""
    queue: WorkQueue[str] = WorkQueue()
    journal: list[str] = []
    stop = asyncio.Event()
    inside = asyncio.Event()

    async def reconcile(key: str) -> float | None:
        journal.append(f"start {key}")
        if key == "a":
            inside.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                journal.append("a: cancellation swallowed")  # the bug this guards against
            queue.add("b")  # more work arrives as it finishes
        return None

    queue.add("a")
    run = asyncio.create_task(run_until_stopped(run_workers(queue, reconcile, workers=1), stop,
                                                on_stop=queue.shutdown))
    await asyncio.wait_for(inside.wait(), BOUND)
    stop.set()
    assert await asyncio.wait_for(run, BOUND) is None
    assert journal == ["start a", "a: cancellation swallowed"], journal
    await asyncio.sleep(0.05)
    assert journal == ["start a", "a: cancellation swallowed"], "a reconcile ran after the call returned"
