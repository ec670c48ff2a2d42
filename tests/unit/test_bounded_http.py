"""Every exchange with what a pod runs is bounded as a whole (dynsnap/runtime/bounded_http.py, issue 39), against
real HTTP servers on 127.0.0.1 written as a hostile pod would: a body that trickles a byte at a time (httpx's
per-read timeout never fires on it), a body of 512 MiB declared, one of unbounded chunks never declared. And
the agent's wake-on-request watch (dynsnap/agent/edge.py): one sleeper whose answers trickle does not delay
another's detection (before, each round waited for every sleeper's answer). The controller's calls to a
frontend (its models list, a pinned request) likewise, and an answer of the wrong shape is a failed answer,
never an exception."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from dynsnap.agent import edge, idle
from dynsnap.controller.frontend import ANSWER_MAX_BYTES, Frontend, FrontendError
from dynsnap.runtime.bounded_http import ExchangeError, exchange

METRICS = b"dynamo_component_inflight_requests 1\ndynamo_component_requests_total 3\n"


@dataclass
class Server:
    port: int
    sent: list[int] = field(default_factory=list)  # bytes of body sent, per answer, as it goes
    finished: list[bool] = field(default_factory=list)


Handler = Callable[[asyncio.StreamWriter, Server, int], Awaitable[None]]


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    box: list[Server] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        srv = box[0]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                               if x.lower().startswith(b"content-length:")), 0)
                if length:
                    await reader.readexactly(length)
                srv.sent.append(0)
                srv.finished.append(False)
                i = len(srv.sent) - 1
                await handler(writer, srv, i)
                srv.finished[i] = True
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    box.append(Server(server.sockets[0].getsockname()[1]))
    try:
        yield box[0]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


async def trickle(writer: asyncio.StreamWriter, srv: Server, i: int) -> None:
    """200 with a 1000-byte body, one byte every 0.1 s (100 s in all)."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    for _ in range(1000):
        writer.write(b"#")
        await writer.drain()
        srv.sent[i] += 1
        await asyncio.sleep(0.1)


async def huge_declared(writer: asyncio.StreamWriter, srv: Server, i: int) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 536870912\r\n\r\n")
    for _ in range(512):  # 512 MiB, as far as the client reads it
        writer.write(b"x" * (1 << 20))
        await writer.drain()
        srv.sent[i] += 1 << 20


async def huge_chunked(writer: asyncio.StreamWriter, srv: Server, i: int) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(512):
        writer.write(b"100000\r\n" + b"x" * (1 << 20) + b"\r\n")
        await writer.drain()
        srv.sent[i] += 1 << 20
    writer.write(b"0\r\n\r\n")


async def metrics(writer: asyncio.StreamWriter, srv: Server, i: int) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(METRICS) + METRICS)
    await writer.drain()
    srv.sent[i] = len(METRICS)


async def test_a_trickled_body_ends_at_the_deadline_though_every_read_is_quick() -> None:
    async with serve(trickle) as srv, httpx.AsyncClient(timeout=1.0, trust_env=False) as http:
        with pytest.raises(ExchangeError) as e:
            await exchange(http, "GET", f"http://127.0.0.1:{srv.port}/metrics", deadline=1.5, max_bytes=1 << 20)
        assert e.value.cause == "deadline" and "no whole answer within 1.5 s" in str(e.value)
        # the per-read timeout (1 s) alone never ends it: a byte came every 0.1 s
        assert srv.finished == [False] and 0 < srv.sent[0] < 1000


@pytest.mark.parametrize("handler", [huge_declared, huge_chunked], ids=["declared", "chunked"])
async def test_an_answer_over_the_cap_is_refused_as_it_comes(handler: Handler) -> None:
    async with serve(handler) as srv, httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
        with pytest.raises(ExchangeError) as e:
            await exchange(http, "GET", f"http://127.0.0.1:{srv.port}/metrics", deadline=60, max_bytes=4 << 20)
        assert e.value.cause == "size" and "4194304 bytes" in str(e.value)
        assert srv.finished == [False], "read to the end"


async def test_a_small_answer_is_whole_and_idle_scrape_names_the_bound_it_passed() -> None:
    async with serve(metrics) as srv, httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
        r = await exchange(http, "GET", f"http://127.0.0.1:{srv.port}/metrics", deadline=5, max_bytes=1 << 10)
        assert (r.status, r.body) == (200, METRICS)
        assert (await idle.scrape(f"http://127.0.0.1:{srv.port}/metrics")).inflight == 1
    async with serve(trickle) as srv:
        with pytest.raises(idle.MetricsUnavailable) as m:
            await idle.scrape(f"http://127.0.0.1:{srv.port}/metrics", timeout=1.0)
        assert m.value.cause == "deadline"
    async with serve(huge_declared) as srv:
        with pytest.raises(idle.MetricsUnavailable) as m:
            await idle.scrape(f"http://127.0.0.1:{srv.port}/metrics", timeout=30)
        assert m.value.cause == "size"


async def quiet_then_busy(writer: asyncio.StreamWriter, srv: Server, i: int) -> None:
    """A sleeper's page: nothing in flight at its first look, a request in flight from the second on."""
    page = METRICS if i else METRICS.replace(b"requests 1", b"requests 0")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(page) + page)
    await writer.drain()
    srv.sent[i] = len(page)


async def test_one_trickling_sleeper_delays_no_other_sleepers_wake_on_request() -> None:
    """Two routable sleepers: A's /metrics trickles (a look never completes), B's says nothing in flight at its
    first look and a request in flight after. B is passed on at its second look, while A's first look is still
    being answered; A never is. (Before, the second round waited for A's first answer.)"""
    woken: list[tuple[str, bool]] = []
    async with serve(trickle) as a, serve(quiet_then_busy) as b:
        stop = asyncio.Event()
        sleepers = [edge.Sleeper("ns/a", f"http://127.0.0.1:{a.port}/metrics"),
                    edge.Sleeper("ns/b", f"http://127.0.0.1:{b.port}/metrics")]

        def on_request(key: str) -> None:
            woken.append((key, bool(a.sent) and not a.finished[0]))
            stop.set()
        # A look may take up to 30 s (the timeout), far longer than A's answer would ever leave B waiting.
        await asyncio.wait_for(edge.watch(lambda: sleepers, on_request, interval=0.05, stop=stop, timeout=30),
                               timeout=60)
    assert woken == [("ns/b", True)], "B's request seen while A's answer was still trickling"
    assert len(b.sent) >= 2 and b.sent[0] > 0


def json_answer(body: bytes) -> Handler:
    async def handler(writer: asyncio.StreamWriter, srv: Server, i: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        await writer.drain()
        srv.sent[i] = len(body)
    return handler


@pytest.mark.parametrize(("body", "says"), [
    (b'[{"id": "tiny"}]', "not a model list"), (b'{"data": {"id": "tiny"}}', "not a model list"),
    (b"not json", "not JSON")])
async def test_a_models_list_of_the_wrong_shape_is_a_frontend_error_not_a_crash(body: bytes, says: str) -> None:
    fe = Frontend(timeout=5, attempts=1)
    try:
        async with serve(json_answer(body)) as srv:
            with pytest.raises(FrontendError) as e:
                await fe.models(f"http://127.0.0.1:{srv.port}")
        assert says in str(e.value)
    finally:
        await fe.close()


@pytest.mark.parametrize(("body", "error"), [
    (b'[1, 2]', "answer is not a JSON object"),
    (b'{"nvext": {"worker_id": "not-a-number"}}', ""),
    (b'{"nvext": [7]}', ""),
    (b'{"nvext": {"worker_id": {"decode_worker_id": -7, "prefill_worker_id": 1.5}}}', "")])
async def test_a_pinned_answer_of_the_wrong_shape_names_no_worker_and_raises_nothing(body: bytes, error: str) -> None:
    fe = Frontend(timeout=5, attempts=1)
    try:
        async with serve(json_answer(body)) as srv:
            a = await fe.pinned(f"http://127.0.0.1:{srv.port}", "tiny", worker_id=7, prefill_id=None)
        assert (a.status, a.worker_id, a.prefill_id) == (200, None, None) and error in a.error
        assert not a.answered_by(worker_id=7, prefill_id=None)
    finally:
        await fe.close()


async def test_a_pinned_answer_that_trickles_or_swells_ends_within_the_bounds() -> None:
    fe = Frontend(timeout=1.5, attempts=1)
    try:
        async with serve(trickle) as srv:
            a = await fe.pinned(f"http://127.0.0.1:{srv.port}", "tiny", worker_id=7, prefill_id=None)
        assert a.status == 0 and "no whole answer within 1.5 s" in a.error
        async with serve(huge_chunked) as srv:
            a = await fe.pinned(f"http://127.0.0.1:{srv.port}", "tiny", worker_id=7, prefill_id=None)
        assert a.status == 0 and f"{ANSWER_MAX_BYTES} bytes" in a.error
    finally:
        await fe.close()


async def test_a_worker_whose_metrics_pass_a_bound_is_said_once_per_episode() -> None:
    """The agent's idle scrape (NodeAgent._idle) of a worker whose /metrics trickles: a Warning
    MetricsOutOfBounds once, not at every scrape; an answer within the bounds ends the episode, and the next
    one is said again. The worker's idle facts are left as they were."""
    from dynsnap.agent.node import NodeAgent
    from dynsnap.agent.settings import AgentSettings
    from dynsnap.models.protocol import ObservedState
    from dynsnap.models.workersnapshot import WorkerSnapshot

    said: list[tuple[str, str]] = []

    class Events:
        async def record(self, obj: object, *, type: str, reason: str, action: str, note: str) -> None:
            said.append((type, reason))

    ws = WorkerSnapshot.model_validate({
        "apiVersion": "dynsnap.io/v1alpha1", "kind": "WorkerSnapshot",
        "metadata": {"name": "w-0", "namespace": "ns", "uid": "x", "generation": 1},
        "spec": {"podName": "w-0", "podUID": "11111111-2222-3333-4444-555555555555", "desiredState": "Active",
                 "tier": "suspend"}})
    obs = SimpleNamespace(state=ObservedState.ACTIVE)
    async with serve(trickle) as bad, serve(metrics) as good:
        agent = NodeAgent(kube=cast(Any, SimpleNamespace(on_request=1)), executor=cast(Any, None), events=Events(),
                          settings=AgentSettings(node_name="n", metrics_port=bad.port))
        status = ws.status.model_copy(deep=True)
        pod = {"status": {"podIP": "127.0.0.1"}}
        for _ in range(3):
            await agent._idle(ws, status, pod, cast(Any, obs))
        assert said == [("Warning", "MetricsOutOfBounds")] and status.idle is None
        agent.settings = AgentSettings(node_name="n", metrics_port=good.port)
        await agent._idle(ws, status, pod, cast(Any, obs))
        assert status.idle is not None and status.idle.inflight == 1
        agent.settings = AgentSettings(node_name="n", metrics_port=bad.port)
        await agent._idle(ws, status, pod, cast(Any, obs))
        assert said == [("Warning", "MetricsOutOfBounds")] * 2


async def test_a_routable_sleeper_whose_gauge_trickles_is_said_once_and_woken_never() -> None:
    """The wake-on-request watch's look at a sleeper whose /metrics trickles ends at its bound every time;
    ``on_unbounded`` hears of it once for the episode (cause ``deadline``), ``on_request`` never."""
    said: list[tuple[str, str]] = []
    woken: list[str] = []
    async with serve(trickle) as a:
        stop = asyncio.Event()
        sleepers = [edge.Sleeper("ns/a", f"http://127.0.0.1:{a.port}/metrics")]

        def on_unbounded(key: str, e: ExchangeError) -> None:
            said.append((key, e.cause))
        task = asyncio.create_task(edge.watch(lambda: sleepers, woken.append, interval=0.02, stop=stop,
                                              timeout=0.2, on_unbounded=on_unbounded))
        for _ in range(200):  # bounded: until three looks have ended at the deadline
            if len(a.sent) >= 3:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 10)
    assert len(a.sent) >= 3, a.sent
    assert said == [("ns/a", "deadline")] and woken == []
