"""What the controller asks a Dynamo frontend (ai-dynamo 1.6.1), over HTTP, its GETs retried by the
named policy ``dynsnap.k8s.retry.FRONTEND`` (attempts and total time capped, ``DYNSNAP_RETRY_INSTANT``
honoured):

- demand: ``/metrics`` -> ``dynamo_frontend_inflight_requests`` and ``dynamo_frontend_queued_requests``,
  each summed over the models it serves (gauges; the queued requests are among those in flight:
  ``plan.Demand``; DESIGN.md section 3.1: the controller scrapes only
  frontends, the agents scrape their own workers). Every opted-in graph's frontend is scraped every
  interval, so this GET is the controller's most frequent act: it goes over one kept-alive HTTP/1.1
  connection per frontend (:class:`MetricsScraper`), not through httpx, whose shared pool scans every
  pooled connection per request and reconnected across hundreds of frontends (docs/BENCHMARKS.md,
  bench/scale: the scrape was a third of the controller's CPU at 50 graphs);
- the models it serves (``/v1/models``);
- a chat completion pinned to one worker (``x-dynamo-worker-instance-id``, decimal; a prefill worker
  ``x-dynamo-prefill-instance-id``), asking ``nvext.extra_fields: ["worker_id"]`` so the answer says
  which worker produced it. A pinned request never falls back (unknown id 400, quarantined 500,
  frozen 504), so an answer carrying the id is proof the worker served it.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import httpx

from dynsnap.controller.plan import Demand
from dynsnap.k8s.errors import RetryExhausted
from dynsnap.k8s.retry import FRONTEND, RetryPolicy
from dynsnap.models import protocol as P
from dynsnap.models.dynamo import worker_ids_from
from dynsnap.models.ids import InstanceId
from dynsnap.runtime.bounded_http import Answer, ExchangeError, exchange
from dynsnap.telemetry import promtext

T = TypeVar("T")

# A models list or a pinned completion of a few tokens is a few KiB; a frontend's answer past this is refused.
ANSWER_MAX_BYTES = 1 << 20
INFLIGHT = "dynamo_frontend_inflight_requests"
QUEUED = "dynamo_frontend_queued_requests"


class FrontendError(RuntimeError):
    """The frontend could not be asked (connection refused, timeout, a non-metrics answer)."""


def parse_demand(text: str) -> Demand:
    """In-flight and queued requests over every model (pure; read by ``dynsnap.telemetry.promtext``,
    which leaves out NaN, infinite and negative values: no demand figure, and they would break the
    planner's ceil). Missing series count as 0; a page with no frontend metric at all is not a
    frontend's."""
    found = promtext.samples(text, (INFLIGHT, QUEUED))
    # The gauges appear only once a model has been asked for; before that any dynamo_frontend_
    # series (or its HELP line) says it is a frontend's page, with nothing in flight.
    if not found and "dynamo_frontend_" not in text:
        raise FrontendError(f"no {INFLIGHT} or {QUEUED} series, and no dynamo_frontend_ metric at all")
    return Demand(inflight=promtext.total(found, INFLIGHT) or 0.0, queued=promtext.total(found, QUEUED) or 0.0)


@dataclass(frozen=True)
class PinnedAnswer:
    status: int
    worker_id: InstanceId | None
    prefill_id: InstanceId | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200

    def answered_by(self, *, worker_id: int | None, prefill_id: int | None) -> bool:
        """Answered (200) and naming every worker it was pinned to: the worker id for an aggregated
        worker, the prefill id for a prefill worker, both for a decode worker of a disaggregated
        graph (the prefill half of the answer is proof too: a decode worker that served it with
        another prefill worker was not asked what the verification asked)."""
        return (self.ok and (worker_id is None or self.worker_id == worker_id)
                and (prefill_id is None or self.prefill_id == prefill_id))


def pin_headers(*, worker_id: int | None, prefill_id: int | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if worker_id is not None:
        headers[P.HEADER_WORKER_INSTANCE_ID] = str(worker_id)  # decimal: hex is silently ignored
    if prefill_id is not None:
        headers[P.HEADER_PREFILL_INSTANCE_ID] = str(prefill_id)
    return headers


class ScrapeError(Exception):
    """One GET could not be done (connect, send, a malformed or oversized answer, a timeout)."""


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    used: float

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class MetricsScraper:
    """``GET`` of a small page (a frontend's ``/metrics``) over one kept-alive HTTP/1.1 connection per
    frontend, one request at a time on it: a scrape costs a write and a read, no pool to search, no
    connect. A connection the frontend closed while it sat idle is redialled once at once (that is
    no failure of the frontend); connections unused for ``idle_close`` seconds (a frontend gone or no
    longer scraped) are closed. Answers: ``Content-Length``, chunked, or up to the close; at most
    ``max_bytes``; the whole exchange within ``timeout``."""

    def __init__(self, *, timeout: float, max_bytes: int = 8 << 20, idle_close: float = 60.0) -> None:
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.idle_close = idle_close
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._swept = time.monotonic()

    async def get(self, url: str) -> tuple[int, str]:
        """(HTTP status, body) of ``GET url`` (``http://host:port/path``); ScrapeError when not answered."""
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ScrapeError(f"not an http:// URL: {url}")
        key = (u.hostname, u.port or 80)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        request = (f"GET {target} HTTP/1.1\r\nHost: {u.netloc}\r\nAccept: text/plain\r\n"
                   "User-Agent: dynsnap-controller\r\n\r\n").encode()
        self._sweep()
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            conn = self._conns.pop(key, None)
            for fresh in ((False, True) if conn is not None else (True,)):
                try:
                    if fresh:
                        reader, writer = await asyncio.wait_for(asyncio.open_connection(*key), self.timeout)
                        conn = _Conn(reader, writer, time.monotonic())
                    assert conn is not None
                    status, body, keep = await asyncio.wait_for(self._exchange(conn, request), self.timeout)
                except (OSError, TimeoutError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                        ValueError, ScrapeError) as e:
                    if conn is not None:
                        conn.close()
                    conn = None
                    if not fresh and not isinstance(e, TimeoutError):
                        continue  # a kept-alive connection the frontend had closed: dial it again once
                    raise ScrapeError(f"{type(e).__name__}: {e}") from e
                conn.used = time.monotonic()
                if keep:
                    self._conns[key] = conn
                else:
                    conn.close()
                return status, body
        raise ScrapeError("unreachable")  # pragma: no cover - the loop returns or raises

    async def _exchange(self, conn: _Conn, request: bytes) -> tuple[int, str, bool]:
        conn.writer.write(request)
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")  # the reader's 64 KiB limit bounds it
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ScrapeError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        status = int(parts[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        keep = connection != "close" if parts[0] == "HTTP/1.1" else connection == "keep-alive"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._chunked(conn.reader)
        elif "content-length" in headers:
            n = int(headers["content-length"])
            if not 0 <= n <= self.max_bytes:
                raise ScrapeError(f"Content-Length {n} is over {self.max_bytes} bytes")
            body = await conn.reader.readexactly(n)
        else:  # the body runs to the close
            body = await conn.reader.read(self.max_bytes + 1)
            while len(body) <= self.max_bytes and (more := await conn.reader.read(self.max_bytes + 1 - len(body))):
                body += more
            if len(body) > self.max_bytes:
                raise ScrapeError(f"answer over {self.max_bytes} bytes")
            keep = False
        return status, body.decode("utf-8", errors="replace"), keep

    async def _chunked(self, reader: asyncio.StreamReader) -> bytes:
        out = bytearray()
        for _ in range(1 + self.max_bytes):  # each chunk is at least one byte: a bound, never reached
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, bounded by the reader's limit
                    pass
                return bytes(out)
            if len(out) + size > self.max_bytes:
                raise ScrapeError(f"answer over {self.max_bytes} bytes")
            out += await reader.readexactly(size)
            if await reader.readexactly(2) != b"\r\n":
                raise ScrapeError("malformed chunk")
        raise ScrapeError("too many chunks")  # pragma: no cover

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._swept < self.idle_close / 2:
            return
        self._swept = now
        for key, conn in list(self._conns.items()):
            if now - conn.used > self.idle_close:
                conn.close()
                del self._conns[key]
        for key in [k for k, lock in self._locks.items() if k not in self._conns and not lock.locked()]:
            del self._locks[key]

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


class Frontend:
    """One client for every frontend the controller talks to: httpx (connection pool shared) for
    the rare requests (models, pinned requests), :class:`MetricsScraper` for the demand scrape."""

    def __init__(self, *, timeout: float = 10.0, attempts: int = FRONTEND.attempts) -> None:
        self.timeout = timeout  # also each exchange's total bound (runtime.bounded_http)
        self.http = httpx.AsyncClient(timeout=timeout, trust_env=False)
        self.scraper = MetricsScraper(timeout=timeout)
        # Each GET within the whole policy: its attempts, and at least one whole timeout per attempt.
        self.retry: RetryPolicy = dataclasses.replace(FRONTEND, attempts=attempts,
                                                      timeout=max(FRONTEND.timeout, timeout * attempts))

    async def close(self) -> None:
        await self.scraper.close()
        await self.http.aclose()

    async def _retried(self, url: str, once: Callable[[], Awaitable[T]]) -> T:
        """``once`` under the frontend retry policy (dynsnap.k8s.retry.FRONTEND): a request that got
        no answer (``once`` raises ConnectionError) is tried again; a FrontendError when none did."""
        try:
            return await self.retry.call(f"GET {url}", once)
        except RetryExhausted as e:
            raise FrontendError(f"GET {url}: {e.last}") from e

    async def _get(self, url: str) -> Answer:
        async def once() -> Answer:
            try:
                return await exchange(self.http, "GET", url, deadline=self.timeout, max_bytes=ANSWER_MAX_BYTES)
            except ExchangeError as e:
                if e.cause == "size":  # an answer, too large: asking again gets the same
                    raise FrontendError(str(e)) from e
                raise ConnectionError(str(e)) from e
        return await self._retried(url, once)

    async def demand(self, base: str) -> Demand:
        url = f"{base}/metrics"

        async def once() -> tuple[int, str]:
            try:
                return await self.scraper.get(url)
            except ScrapeError as e:
                raise ConnectionError(str(e)) from e
        status, text = await self._retried(url, once)
        if status != 200:
            raise FrontendError(f"GET {url}: HTTP {status}")
        return parse_demand(text)

    async def models(self, base: str) -> list[str]:
        r = await self._get(f"{base}/v1/models")
        if r.status != 200:
            raise FrontendError(f"GET {base}/v1/models: HTTP {r.status}")
        try:
            data = r.json()
        except ValueError as e:
            raise FrontendError(f"GET {base}/v1/models: the answer is not JSON") from e
        listed = data.get("data") if isinstance(data, dict) else None
        if not isinstance(listed, list):
            raise FrontendError(f"GET {base}/v1/models: the answer is not a model list ({r.text[:200]!r})")
        return [str(m["id"]) for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def pinned(self, base: str, model: str, *, worker_id: int | None, prefill_id: int | None,
                     max_tokens: int = 4) -> PinnedAnswer:
        """One chat completion pinned to a worker. Transport errors are an answer with status 0."""
        body = {"model": model, "messages": [{"role": "user", "content": "dynsnap verify"}],
                "max_tokens": max_tokens, "stream": False, "nvext": {"extra_fields": ["worker_id"]}}
        try:
            r = await exchange(self.http, "POST", f"{base}/v1/chat/completions", json=body,
                               headers=pin_headers(worker_id=worker_id, prefill_id=prefill_id),
                               deadline=self.timeout, max_bytes=ANSWER_MAX_BYTES)
        except ExchangeError as e:
            return PinnedAnswer(0, None, None, str(e))
        if r.status != 200:
            return PinnedAnswer(r.status, None, None, r.text[:300])
        try:
            data = r.json()
        except ValueError:
            return PinnedAnswer(r.status, None, None, "answer is not JSON")
        if not isinstance(data, dict):
            return PinnedAnswer(r.status, None, None, f"answer is not a JSON object: {r.text[:200]!r}")
        decode, prefill = worker_ids_from(data)
        return PinnedAnswer(200, decode, prefill)
