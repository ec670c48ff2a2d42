"""A tiny HTTP endpoint for a long-running process: ``/healthz`` (the process's loop answers),
``/readyz`` (its informers have synced and it may act) and ``/metrics`` (Prometheus text that
the owner renders). asyncio streams only; one request per connection; bounded reads.

Layer: ``dynsnap.runtime``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

Probe = Callable[[], bool]


class HealthServer:
    def __init__(self, *, host: str, port: int, ready: Probe, metrics: Callable[[], str] | None = None) -> None:
        self.host = host
        self.port = port
        self.ready = ready
        self.metrics = metrics
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        sock = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            parts = line.decode("latin-1").split()
            path = parts[1] if len(parts) >= 2 else "/"
            if path == "/healthz":
                code, body = 200, "ok\n"
            elif path == "/readyz":
                code, body = (200, "ready\n") if self.ready() else (503, "not ready\n")
            elif path == "/metrics" and self.metrics is not None:
                code, body = 200, self.metrics()
            else:
                code, body = 404, "not found\n"
            data = body.encode()
            head = (f"HTTP/1.0 {code} {'OK' if code == 200 else 'Error'}\r\nContent-Type: text/plain\r\n"
                    f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + data)
            await asyncio.wait_for(writer.drain(), 5.0)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
