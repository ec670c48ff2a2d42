"""fake_held_link: a TCP relay from a pod to the API server that a test can hold. It stands in for a
client's link to the API server going quiet while the client itself carries on (a partition between
the node and the control plane, an API server too loaded to answer): the client's watches deliver
nothing, so its view of the cluster lags, exactly as long as the test says.

Transparent: bytes pass untouched both ways (TLS end to end, the client sees the API server's own
certificate, whose SANs include the sandbox network's gateway it listens on), one upstream connection
per client connection. ``hold()`` stops every byte in both directions on every connection, open or
new; ``release()`` lets what was held through, in order. Only the real API server ever answers.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass
class HeldLink:
    host: str  # where the client connects: the sandbox network's gateway (pods reach the host there)
    upstream: tuple[str, int]  # the API server
    port: int = 0  # 0: a free port, known after start()
    _flowing: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _server: asyncio.Server | None = field(default=None, init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set, init=False)

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    async def start(self) -> HeldLink:
        self._flowing.set()
        self._server = await asyncio.start_server(self._on_connect, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> HeldLink:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    @property
    def held(self) -> bool:
        return not self._flowing.is_set()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 30)
        except (OSError, TimeoutError):
            writer.transport.abort()
            self._writers.discard(writer)
            return
        self._writers.add(up_w)
        tasks = [asyncio.create_task(self._pipe(reader, up_w)), asyncio.create_task(self._pipe(up_r, writer))]
        self._tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
            for w in (writer, up_w):
                w.transport.abort()
                self._writers.discard(w)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                await self._flowing.wait()  # held: nothing read passes until released
                dst.write(data)
                await dst.drain()
