"""The demand scrape's HTTP client (dynsnap.controller.frontend.MetricsScraper) against a local server
that answers the way a frontend may: one kept-alive connection reused across scrapes, chunked and
to-the-close bodies, a connection closed by the server while idle (redialled at once, no failure),
bounds on size and time, and Frontend.demand's errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from dynsnap.controller.frontend import Frontend, FrontendError, MetricsScraper, ScrapeError
from dynsnap.k8s import retry

PAGE = 'dynamo_frontend_inflight_requests{model="tiny"} 3\ndynamo_frontend_queued_requests{model="tiny"} 2\n'


@dataclass
class Server:
    """Answers each request with ``answer(n)`` (raw bytes; n counts requests); counts connections."""

    answer: Callable[[int], bytes | None]
    close_after: bool = False  # close the connection after each answer
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            for _ in range(100):
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                data = self.answer(len(self.requests))
                if data is None:
                    await asyncio.sleep(30)  # never answers
                    return
                writer.write(data)
                await writer.drain()
                if self.close_after:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


Serve = Callable[..., Awaitable[Server]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[asyncio.Server] = []

    async def start(answer: Callable[[int], bytes | None], *, close_after: bool = False) -> Server:
        s = Server(answer, close_after=close_after)
        srv = await asyncio.start_server(s.handle, "127.0.0.1", 0)
        s.port = srv.sockets[0].getsockname()[1]
        servers.append(srv)
        return s

    yield start
    for srv in servers:
        srv.close()


def length(body: str, *, status: int = 200, extra: str = "") -> bytes:
    b = body.encode()
    return f"HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\nContent-Length: {len(b)}\r\n{extra}\r\n".encode() + b


async def test_scrapes_reuse_one_connection_and_read_the_body_by_its_length(serve: Serve) -> None:
    s = await serve(lambda n: length(PAGE.replace(" 3", f" {n}")))
    sc = MetricsScraper(timeout=5)
    got = [await sc.get(f"http://127.0.0.1:{s.port}/metrics") for _ in range(5)]
    await sc.close()
    assert [status for status, _ in got] == [200] * 5
    assert [text.splitlines()[0][-1] for _, text in got] == ["1", "2", "3", "4", "5"]
    assert s.connections == 1
    assert s.requests[0].startswith(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:")


async def test_a_chunked_answer_with_trailers(serve: Serve) -> None:
    body = PAGE.encode()
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               + f"{10:x};ext=1\r\n".encode() + body[:10] + b"\r\n"
               + f"{len(body) - 10:x}\r\n".encode() + body[10:] + b"\r\n0\r\nX-Trailer: 1\r\n\r\n")
    s = await serve(lambda n: chunked)
    sc = MetricsScraper(timeout=5)
    for _ in range(2):
        assert await sc.get(f"http://127.0.0.1:{s.port}/metrics") == (200, PAGE)
    await sc.close()
    assert s.connections == 1  # the chunked answer ended where it should: the connection stays usable


async def test_connection_close_and_a_body_to_the_close_take_a_new_connection_each(serve: Serve) -> None:
    s = await serve(lambda n: b"HTTP/1.0 200 OK\r\n\r\n" + PAGE.encode(), close_after=True)
    sc = MetricsScraper(timeout=5)
    assert await sc.get(f"http://127.0.0.1:{s.port}/metrics") == (200, PAGE)
    assert await sc.get(f"http://127.0.0.1:{s.port}/metrics") == (200, PAGE)
    await sc.close()
    assert s.connections == 2


async def test_a_kept_connection_the_server_closed_while_idle_is_dialled_again_without_an_error(serve: Serve) -> None:
    s = await serve(lambda n: length(PAGE))
    sc = MetricsScraper(timeout=5)
    await sc.get(f"http://127.0.0.1:{s.port}/metrics")
    for w in s.writers:
        w.close()  # the frontend drops the idle connection (restart, its keep-alive timeout)
    await asyncio.sleep(0.05)
    assert await sc.get(f"http://127.0.0.1:{s.port}/metrics") == (200, PAGE)
    await sc.close()
    assert s.connections == 2


async def test_answers_over_the_size_bound_are_refused(serve: Serve) -> None:
    big = await serve(lambda n: length("x" * 2000))
    sc = MetricsScraper(timeout=5, max_bytes=1000)
    with pytest.raises(ScrapeError, match="Content-Length 2000 is over 1000 bytes"):
        await sc.get(f"http://127.0.0.1:{big.port}/metrics")
    chunks = await serve(lambda n: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + (b"1f4\r\n" + b"x" * 500 + b"\r\n") * 3 + b"0\r\n\r\n")
    with pytest.raises(ScrapeError, match="answer over 1000 bytes"):
        await sc.get(f"http://127.0.0.1:{chunks.port}/metrics")
    await sc.close()


async def test_a_frontend_that_never_answers_fails_within_the_timeout(serve: Serve) -> None:
    s = await serve(lambda n: None)
    sc = MetricsScraper(timeout=0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ScrapeError, match="TimeoutError"):
        await sc.get(f"http://127.0.0.1:{s.port}/metrics")
    assert loop.time() - t0 < 5
    await sc.close()


async def test_idle_connections_are_closed_after_idle_close(serve: Serve) -> None:
    a = await serve(lambda n: length(PAGE))
    b = await serve(lambda n: length(PAGE))
    sc = MetricsScraper(timeout=5, idle_close=0.2)
    await sc.get(f"http://127.0.0.1:{a.port}/metrics")
    await asyncio.sleep(0.3)
    await sc.get(f"http://127.0.0.1:{b.port}/metrics")  # a's connection, unused for 0.3 s, is swept
    assert set(sc._conns) == {("127.0.0.1", b.port)}
    await sc.close()


async def test_demand_parses_the_page_and_names_what_went_wrong(serve: Serve) -> None:
    ok = await serve(lambda n: length(PAGE))
    down = await serve(lambda n: length("starting", status=503))
    fe = Frontend(timeout=2, attempts=2)
    d = await fe.demand(f"http://127.0.0.1:{ok.port}")
    assert (d.inflight, d.queued) == (3.0, 2.0)
    with pytest.raises(FrontendError, match=r"/metrics: HTTP 503"):
        await fe.demand(f"http://127.0.0.1:{down.port}")
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    with pytest.raises(FrontendError, match=r"GET http://127.0.0.1:\d+/metrics: ConnectionRefusedError"):
        await fe.demand(f"http://127.0.0.1:{port}")
    await fe.close()


async def test_a_get_that_got_no_answer_is_retried_by_the_named_policy_within_its_caps(serve: Serve) -> None:
    """The frontend's GETs go through dynsnap.k8s.retry.FRONTEND (no loop of their own): a connection
    dropped before the answer is tried again; given up after the policy's attempts, named in the error."""
    events: list[retry.RetryEvent] = []
    retry.add_hook(events.append)
    retry.set_instant(True)
    try:
        flaky = await serve(lambda n: None if n == 1 else length(PAGE), close_after=True)
        flaky.answer = lambda n: length(PAGE) if n > 1 else b"HTTP/1.1 200 X\r\nContent-Length: 99\r\n\r\ncut"
        fe = Frontend(timeout=2)
        assert (await fe.demand(f"http://127.0.0.1:{flaky.port}")).inflight == 3.0
        assert [(e.policy, e.attempt, e.gave_up) for e in events] == [("frontend-get", 1, False)]
        events.clear()
        never = await serve(lambda n: b"HTTP/1.1 200 X\r\nContent-Length: 99\r\n\r\ncut", close_after=True)
        with pytest.raises(FrontendError, match=r"GET http://127.0.0.1:\d+/metrics: IncompleteReadError"):
            await fe.demand(f"http://127.0.0.1:{never.port}")
        assert [(e.attempt, e.gave_up) for e in events] == [(1, False), (2, False), (3, True)]
        assert len(never.requests) == retry.FRONTEND.attempts
        await fe.close()
    finally:
        retry.set_instant(None)
        retry.remove_hook(events.append)
