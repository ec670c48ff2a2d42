"""fake_apiproxy: faults the real API server cannot be made to produce on demand (layer: testenv).

It stands in for a troubled hop between a client and the API server (a load balancer, an
overloaded or restarting API-server instance, a flaky network): 429 Too Many Requests with
``Retry-After``, 503, connections reset at accept or mid-stream, a watch stream that goes silent
while its TCP connection stays up, a request held until the test lets it through. Everything
that is not a fault is the real API server's own answer, byte for byte.

Design (the simplest honest one found): an asyncio server on 127.0.0.1 (or the run's bridge
gateway, for the real node's pods) that terminates TLS with the test PKI's serving certificate (its
SANs include both, and clients already trust the test CA, so a client is pointed at the proxy
exactly as at the API server) and opens a new TLS connection to the real API server for every
request. It reads each request's head, rewrites it
to ``Connection: close`` (the API server then ends the connection after its response, so the
client's next request comes on a new connection where the proxy sees it again; with keep-alive
later requests would slip past unseen), and forwards bytes both ways without parsing them:
chunked watch streams pass untouched. Request bodies are forwarded as they come.

Faults are matched per request (method, path and query substrings or the exact path, watch or
not), each for a number of hits, first match wins:

    respond       answer ``status`` with ``headers``/``body`` (default: a Status object) without
                  contacting the API server
    reset         abort the connection with a TCP RST instead of answering
    reset_after   forward; RST once ``after_bytes`` bytes of the response body went through
    silent_after  forward ``after_bytes`` body bytes, then swallow the rest while keeping the
                  connection open (a half-dead stream); ends when the client hangs up
    stall         hold the request (the API server does not see it) until ``release()``

``refuse_next(n)`` resets the next n connections at accept, before TLS; ``abort_all()`` resets
every open connection (a blip that cuts live watches). ``requests`` records every request seen
(method, path, query, fault), so a test counts what was asked without trusting the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import struct
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from dynsnap.testenv.controlplane import ControlPlane

log = logging.getLogger(__name__)

Action = Literal["respond", "reset", "reset_after", "silent_after", "stall"]

_HEAD_LIMIT = 64 * 1024
_IO_TIMEOUT = 30.0  # a peer that sends no request head (or no upstream connect) for this long is gone
_HOLD_MAX = 600.0  # longest a stall or a silent stream is held; tests release far sooner


@dataclass
class Fault:
    action: Action
    method: str | None = None
    path_contains: str = ""
    path_equals: str | None = None  # the whole path: a subresource's parent without the subresource
    query_contains: str = ""
    watch: bool | None = None  # True: only watch requests; False: only non-watch requests
    times: int | None = 1  # hits before the fault retires; None: every matching request
    status: int = 503
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    after_bytes: int = 0
    hits: int = 0

    def matches(self, method: str, path: str, query: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method is not None and self.method != method:
            return False
        if self.path_contains not in path or self.query_contains not in query:
            return False
        if self.path_equals is not None and path != self.path_equals:
            return False
        return self.watch is None or self.watch == _is_watch(query)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: str
    fault: str | None

    @property
    def watch(self) -> bool:
        return _is_watch(self.query)


def _is_watch(query: str) -> bool:
    return "watch=true" in query.split("&") or "watch=1" in query.split("&")


@dataclass
class FakeApiProxy:
    upstream: str  # the real API server, https://host:port
    ca_cert: Path  # trusted for the upstream connection
    serving_cert: Path  # presented to clients (its SANs: 127.0.0.1 and the run's bridge gateway)
    serving_key: Path
    port: int = 0  # 0: any free port on ``host``
    host: str = "127.0.0.1"  # the run's bridge gateway: where the real node's pods reach the host
    faults: list[Fault] = field(default_factory=list, init=False)
    requests: list[Seen] = field(default_factory=list, init=False)
    stalled: int = field(default=0, init=False)  # requests currently held by a stall
    _server: asyncio.Server | None = field(default=None, init=False)
    _refuse: int = field(default=0, init=False)
    _open: set[asyncio.StreamWriter] = field(default_factory=set, init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _releases: list[asyncio.Event] = field(default_factory=list, init=False)
    _stall_began: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    @classmethod
    def in_front_of(cls, cp: ControlPlane, host: str = "127.0.0.1") -> FakeApiProxy:
        """A proxy for the local control plane's API server on ``host``, presenting its own serving
        certificate."""
        assert cp.pki is not None and cp.url, "control plane not started"
        return cls(upstream=cp.url, ca_cert=cp.pki.ca_cert, serving_cert=cp.pki.serving_cert,
                   serving_key=cp.pki.serving_key, host=host)

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    async def start(self) -> FakeApiProxy:
        self._server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._server_ctx.load_cert_chain(str(self.serving_cert), str(self.serving_key))
        self._server_ctx.set_alpn_protocols(["http/1.1"])
        self._client_ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        self._client_ctx.set_alpn_protocols(["http/1.1"])
        up = urlsplit(self.upstream)
        assert up.hostname and up.port, self.upstream
        self._up_host, self._up_port = up.hostname, up.port
        self._server = await asyncio.start_server(self._on_connect, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.release()
        self.abort_all()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> FakeApiProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- controls ----------------------------------------------------------------------------------

    def add(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        self.faults.clear()

    def refuse_next(self, n: int) -> None:
        self._refuse += n

    def abort_all(self) -> int:
        """Reset every open client connection; returns how many."""
        writers = list(self._open)
        for w in writers:
            _rst(w)
        return len(writers)

    def release(self) -> None:
        """Let every stalled request through to the API server."""
        for ev in self._releases:
            ev.set()
        self._releases.clear()

    async def wait_stalled(self, n: int = 1, *, timeout: float = 30.0) -> None:
        """Wait until at least ``n`` requests are held by stalls (bounded by ``timeout``)."""
        async with asyncio.timeout(timeout):
            while self.stalled < n:
                self._stall_began.clear()
                await self._stall_began.wait()

    def seen(self, *, method: str | None = None, path_contains: str = "", watch: bool | None = None) -> list[Seen]:
        return [s for s in self.requests if (method is None or s.method == method) and path_contains in s.path
                and (watch is None or s.watch == watch)]

    # -- per connection ----------------------------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._open.add(writer)
        try:
            if self._refuse > 0:
                self._refuse -= 1
                _rst(writer)
                return
            await writer.start_tls(self._server_ctx, ssl_handshake_timeout=_IO_TIMEOUT)
            await self._serve_one(reader, writer)
        except (ConnectionError, ssl.SSLError, TimeoutError, asyncio.IncompleteReadError, OSError) as e:
            log.debug("fake_apiproxy: connection ended: %s", e)
        except asyncio.CancelledError:
            # stop() cancels what still relays (a watch whose client left reads on until the server
            # ends it). Ended quietly: Python 3.11's start_server logs a cancelled handler as an error.
            log.debug("fake_apiproxy: connection cancelled by stop()")
        finally:
            self._open.discard(writer)
            self._tasks.discard(task)
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _IO_TIMEOUT)
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        parts = urlsplit(target)
        fault = next((f for f in self.faults if f.matches(method, parts.path, parts.query)), None)
        if fault is not None:
            fault.hits += 1
        self.requests.append(Seen(method, parts.path, parts.query, fault.action if fault else None))
        headers = [ln for ln in lines[1:] if ln and not ln.lower().startswith(("connection:", "keep-alive:"))]
        length = next((int(ln.split(":", 1)[1]) for ln in headers if ln.lower().startswith("content-length:")), 0)

        if fault is not None and fault.action == "reset":
            _rst(writer)
            return
        if fault is not None and fault.action == "respond":
            # Read the body first: closing on unread bytes would send an RST that can destroy the answer.
            if length:
                await asyncio.wait_for(reader.readexactly(length), _IO_TIMEOUT)
            writer.write(_response(fault))
            await writer.drain()
            return
        if fault is not None and fault.action == "stall":
            release = asyncio.Event()
            self._releases.append(release)
            self.stalled += 1
            self._stall_began.set()
            try:
                await asyncio.wait_for(release.wait(), _HOLD_MAX)
            finally:
                self.stalled -= 1
            if writer.is_closing():
                return  # its client was cut while it was held: nobody is left to answer

        up_r, up_w = await asyncio.wait_for(asyncio.open_connection(
            self._up_host, self._up_port, ssl=self._client_ctx, server_hostname=self._up_host), _IO_TIMEOUT)
        try:
            up_w.write(("\r\n".join([lines[0], *headers, "Connection: close"]) + "\r\n\r\n").encode("latin-1"))
            to_upstream = asyncio.create_task(_pipe(reader, up_w))
            try:
                if await self._relay_response(up_r, writer, fault) == "silent":
                    await _swallow(up_r, until=to_upstream)
            finally:
                to_upstream.cancel()
                await asyncio.gather(to_upstream, return_exceptions=True)
        finally:
            up_w.transport.abort()

    async def _relay_response(self, up: asyncio.StreamReader, client: asyncio.StreamWriter,
                              fault: Fault | None) -> Literal["done", "reset", "silent"]:
        cut = fault if fault is not None and fault.action in ("reset_after", "silent_after") else None
        pending = b""
        head_sent = False
        body = 0
        while True:
            data = await up.read(65536)
            if not data:
                return "done"
            if not head_sent:
                pending += data
                end = pending.find(b"\r\n\r\n")
                if end < 0:
                    if len(pending) > _HEAD_LIMIT:
                        raise ConnectionError("upstream response head too large")
                    continue
                client.write(pending[:end + 4])
                data, head_sent = pending[end + 4:], True
            if cut is not None:
                allowed = max(0, cut.after_bytes - body)
                if len(data) >= allowed:
                    client.write(data[:allowed])
                    await client.drain()
                    if cut.action == "reset_after":
                        _rst(client)
                        return "reset"
                    return "silent"
            client.write(data)
            body += len(data)
            await client.drain()


def _response(fault: Fault) -> bytes:
    phrase = HTTPStatus(fault.status).phrase
    body = fault.body
    if body is None:
        body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": f"fake_apiproxy: injected {fault.status}",
                           "reason": phrase.replace(" ", ""), "code": fault.status}).encode()
    headers = {"Content-Type": "application/json", **fault.headers, "Content-Length": str(len(body)),
               "Connection": "close"}
    head = f"HTTP/1.1 {fault.status} {phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, ssl.SSLError, OSError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()


async def _swallow(up: asyncio.StreamReader, *, until: asyncio.Task[None]) -> None:
    """Discard the upstream's bytes until the client hangs up (``until``: the client-to-upstream
    pipe, which ends then), bounded by ``_HOLD_MAX``."""
    async def drain_upstream() -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError, OSError):
            while await up.read(65536):
                pass
    drainer = asyncio.create_task(drain_upstream())
    try:
        await asyncio.wait({until}, timeout=_HOLD_MAX)
    finally:
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed peer or a middlebox does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
