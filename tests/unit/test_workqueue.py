"""The work queue: a key is queued once, never processed twice at once, comes back when it was
added during processing, and backs off per key."""

from __future__ import annotations

import asyncio

import pytest

from dynsnap.runtime.workqueue import WorkQueue, run_workers


async def test_dedupes_waiting_keys() -> None:
    q: WorkQueue[str] = WorkQueue()
    for k in ("a", "b", "a", "a"):
        q.add(k)
    assert [await q.get(), await q.get()] == ["a", "b"] and q.depth == 0


async def test_a_key_added_while_processing_comes_back_after_done_not_before() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    key = await q.get()
    q.add("a")  # processing: only marked dirty
    assert q.depth == 0
    q.done(key)
    assert q.depth == 1 and await q.get() == "a"


async def test_one_key_never_runs_twice_at_once() -> None:
    q: WorkQueue[str] = WorkQueue()
    running: set[str] = set()
    overlaps = 0
    calls = 0

    async def reconcile(key: str) -> float | None:
        nonlocal overlaps, calls
        calls += 1
        if key in running:
            overlaps += 1
        running.add(key)
        q.add(key)  # an event for the same key arrives meanwhile
        await asyncio.sleep(0.01)
        running.discard(key)
        return None

    task = asyncio.create_task(run_workers(q, reconcile, workers=4))
    q.add("a")
    for _ in range(100):
        await asyncio.sleep(0.01)
        if calls >= 10:
            break
    q.shutdown()
    await asyncio.wait_for(task, 5)
    assert calls >= 10 and overlaps == 0


async def test_add_after_and_rate_limit_backoff_per_key() -> None:
    q: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=0.04)
    delays = [q.add_rate_limited("a") for _ in range(5)]
    assert delays == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert q.add_rate_limited("b") == 0.01  # per key
    q.forget("a")
    assert q.failures("a") == 0
    for _ in range(1000):  # never an overflow, however long a key keeps failing
        q.add_rate_limited("c")
    assert q.add_rate_limited("c") == 0.04


async def test_failing_reconcile_is_retried_and_a_returned_delay_requeues() -> None:
    q: WorkQueue[str] = WorkQueue(base_delay=0.001)
    seen: list[str] = []

    async def reconcile(key: str) -> float | None:
        seen.append(key)
        if len(seen) == 1:
            raise RuntimeError("first attempt fails")
        return 0.001 if len(seen) < 4 else None

    task = asyncio.create_task(run_workers(q, reconcile, workers=1))
    q.add("k")
    for _ in range(200):
        await asyncio.sleep(0.005)
        if len(seen) >= 4:
            break
    q.shutdown()
    await asyncio.wait_for(task, 5)
    assert seen == ["k"] * 4 and q.stats.errors == 1


async def test_a_reconcile_past_its_bound_is_cancelled_counted_and_queued_again() -> None:
    """One worker; key "stuck" waits on something that never answers (a trickling frontend), key "other" is
    behind it. With a bound, "stuck" is cancelled (its wait sees the cancellation), counted as failed and
    queued again, and "other" is reconciled by the same worker. Without one, "other" would never be."""
    q: WorkQueue[str] = WorkQueue()
    done: list[str] = []
    cancelled: list[str] = []

    async def reconcile(key: str) -> float | None:
        if key == "stuck" and not cancelled:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(key)
                raise
        done.append(key)
        if len(done) == 2:
            q.shutdown()
        return None

    q.add("stuck")
    q.add("other")
    await asyncio.wait_for(run_workers(q, reconcile, workers=1, timeout=0.2), timeout=30)
    assert cancelled == ["stuck"] and done == ["other", "stuck"] and q.stats.errors == 1


async def test_a_timeout_of_the_reconciles_own_is_a_failure_not_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    """A reconcile that raises TimeoutError itself (a wait of its own ran out), with no bound set (the agent's
    queue): counted and logged as a failure with its traceback, never as the bound expiring."""
    q: WorkQueue[str] = WorkQueue()
    calls: list[str] = []

    async def reconcile(key: str) -> float | None:
        calls.append(key)
        if len(calls) == 1:
            raise TimeoutError("its own wait")
        q.shutdown()
        return None

    q.add("a")
    await asyncio.wait_for(run_workers(q, reconcile, workers=1, name="agent"), timeout=30)
    assert calls == ["a", "a"] and q.stats.errors == 1
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    assert len(said) == 1 and said[0][0] == "ERROR" and said[0][1].startswith("agent a failed; again in"), said
    assert caplog.records[-1].exc_info is not None and "its own wait" in str(caplog.records[-1].exc_info[1])


def _graph(key: str) -> str:
    return key.split("-")[0]


async def test_the_groups_waiting_keys_are_taken_in_turn() -> None:
    """Ten keys of graph a waiting, then one of graph b: b's goes second, not eleventh."""
    q: WorkQueue[str] = WorkQueue(group_of=_graph)
    for i in range(10):
        q.add(f"a-{i}")
    q.add("b-0")
    assert [await q.get() for _ in range(4)] == ["a-0", "b-0", "a-1", "a-2"]
    assert q.depth == 7


async def test_a_group_at_its_limit_waits_and_is_served_again_when_one_of_its_keys_is_done() -> None:
    q: WorkQueue[str] = WorkQueue(group_of=_graph, group_limit=2)
    for i in range(3):
        q.add(f"a-{i}")
    first, second = await q.get(), await q.get()
    assert (first, second) == ("a-0", "a-1")
    assert q._next() is None and q.depth == 1  # a-2 waits: its graph holds two
    waiting = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    q.done(first)
    assert await asyncio.wait_for(waiting, 5) == "a-2"


async def test_one_graphs_stuck_reconciles_hold_at_most_their_share_of_the_workers() -> None:
    """Graph a's reconciles never return (a frontend that trickles, before their bound): a holds 2 of the 4
    workers, and graph b's key, added once a's hold what they may, is reconciled all the same. (Without
    the limit every worker is held by a's keys and b's never runs.)"""
    q: WorkQueue[str] = WorkQueue(group_of=_graph, group_limit=2)
    release, b_done = asyncio.Event(), asyncio.Event()
    running: set[str] = set()

    async def reconcile(key: str) -> float | None:
        running.add(key)
        if key.startswith("b"):
            b_done.set()
            return None
        await release.wait()
        return None
    for i in range(6):
        q.add(f"a-{i}")
    workers = asyncio.create_task(run_workers(q, reconcile, workers=4))
    try:
        for _ in range(100):  # every worker has had its turn at the queue (bounded)
            await asyncio.sleep(0)
        assert running == {"a-0", "a-1"}  # the other two workers wait: a is at its limit
        q.add("b-0")  # then b needs a reconcile
        await asyncio.wait_for(b_done.wait(), 10)
        assert {k for k in running if k.startswith("a")} == {"a-0", "a-1"}
    finally:
        release.set()
        q.shutdown()
        await asyncio.wait_for(workers, 10)
