"""stub_frontend: stands in for the Dynamo frontend (``python -m dynamo.frontend``, ai-dynamo 1.6.1)
of every graph of the bench fleet, one asyncio server per frontend pod IP, in one process.

The frontend pods are kwok pods: their IPs exist only in the API. :func:`add_addresses` puts them
on the bench's bridge as /32 addresses of the host, so the controller reaches ``http://<pod IP>:8000``
exactly as it would reach a real frontend, and a listener per IP answers what the controller asks:

- ``GET /metrics``: ``dynamo_frontend_inflight_requests`` and ``dynamo_frontend_queued_requests``
  for the graph's model: the demand the bench sets (:meth:`StubFrontends.set_demand`);
- ``GET /v1/models``: the one model;
- ``POST /v1/chat/completions`` pinned with ``x-dynamo-worker-instance-id`` and/or
  ``x-dynamo-prefill-instance-id``: 200 with ``nvext.worker_id`` naming the pinned ids when every
  pinned worker is routable, else 400 as the real frontend answers an instance it does not route to.
  Routable is what the real frontend's discovery would say: the worker's pod is Ready (its
  EndpointSlice endpoint follows that), asked of a callable the bench passes in.

HTTP/1.1 with keep-alive, bounded reads; nothing else of a frontend (no tokenizer, no engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dynsnap.models import protocol as P
from dynsnap.runtime.command import find_tool, run_command

MAX_HEADER = 16384
MAX_BODY = 1 << 20


@dataclass
class FrontendState:
    graph: str
    inflight: float = 0.0
    set_at: float = 0.0  # time.time() of the last demand change
    scrapes: int = 0
    pinned: int = 0
    refused: int = 0


@dataclass
class StubFrontends:
    """All frontends of the fleet: ``ip -> FrontendState``; ``routable(instance id) -> bool``."""

    routable: Callable[[int], bool]
    model: str = "tiny"
    port: int = P.DYNAMO_FRONTEND_PORT
    by_ip: dict[str, FrontendState] = field(default_factory=dict)
    by_graph: dict[str, FrontendState] = field(default_factory=dict)
    _servers: list[asyncio.Server] = field(default_factory=list)

    async def serve(self, ip: str, graph: str) -> None:
        st = FrontendState(graph)
        self.by_ip[ip] = st
        self.by_graph[graph] = st
        server = await asyncio.start_server(lambda r, w: self._conn(st, r, w), ip, self.port,
                                            reuse_address=True, backlog=64)
        self._servers.append(server)

    def set_demand(self, graph: str, inflight: float) -> float:
        st = self.by_graph[graph]
        st.inflight = inflight
        st.set_at = time.time()
        return st.set_at

    async def close(self) -> None:
        for s in self._servers:
            s.close()
        for s in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(s.wait_closed(), 5.0)
        self._servers.clear()

    # -- HTTP ---------------------------------------------------------------------------------------

    async def _conn(self, st: FrontendState, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(100_000):  # requests on one keep-alive connection: bounded
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120.0)
                if len(head) > MAX_HEADER:
                    return
                lines = head.decode("latin-1").split("\r\n")
                parts = lines[0].split()
                if len(parts) < 2:
                    return
                method, path = parts[0], parts[1]
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length", "0") or 0)
                if n > MAX_BODY:
                    return
                body = await asyncio.wait_for(reader.readexactly(n), 30.0) if n else b""
                code, ctype, data = self._answer(st, method, path, headers, body)
                close = headers.get("connection", "").lower() == "close"
                head_out = (f"HTTP/1.1 {code} {'OK' if code == 200 else 'Error'}\r\nContent-Type: {ctype}\r\n"
                            f"Content-Length: {len(data)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n")
                writer.write(head_out.encode() + data)
                await asyncio.wait_for(writer.drain(), 30.0)
                if close:
                    return
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, st: FrontendState, method: str, path: str, headers: dict[str, str], body: bytes
                ) -> tuple[int, str, bytes]:
        if method == "GET" and path == "/metrics":
            st.scrapes += 1
            text = ("# HELP dynamo_frontend_inflight_requests Number of inflight requests\n"
                    "# TYPE dynamo_frontend_inflight_requests gauge\n"
                    f'dynamo_frontend_inflight_requests{{model="{self.model}"}} {st.inflight:g}\n'
                    "# TYPE dynamo_frontend_queued_requests gauge\n"
                    f'dynamo_frontend_queued_requests{{model="{self.model}"}} 0\n')
            return 200, "text/plain; version=0.0.4", text.encode()
        if method == "GET" and path == "/v1/models":
            return 200, "application/json", json.dumps(
                {"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode()
        if method == "POST" and path == "/v1/chat/completions":
            st.pinned += 1
            wid = headers.get(P.HEADER_WORKER_INSTANCE_ID)
            pid = headers.get(P.HEADER_PREFILL_INSTANCE_ID)
            try:
                ids = [int(x) for x in (wid, pid) if x is not None]
            except ValueError:
                return 400, "application/json", b'{"error": "bad instance id"}'
            if not ids or not all(self.routable(i) for i in ids):
                st.refused += 1
                return 400, "application/json", json.dumps(
                    {"error": f"instance {ids} not found among routable workers"}).encode()
            wid_v: dict[str, int] = {}
            if wid is not None:
                wid_v["decode_worker_id"] = int(wid)
            if pid is not None:
                wid_v["prefill_worker_id"] = int(pid)
            answer = {"id": "stub", "object": "chat.completion", "model": self.model,
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                   "finish_reason": "length"}],
                      "nvext": {"worker_id": wid_v}}
            return 200, "application/json", json.dumps(answer).encode()
        return 404, "text/plain", b"not found\n"


async def add_addresses(bridge: str, ips: list[str]) -> None:
    """Put each frontend pod IP on the bench's bridge as a /32 host address (one ``ip -batch``)."""
    await _batch([f"address add {ip}/32 dev {bridge}" for ip in ips], check=True)


async def del_addresses(bridge: str, ips: list[str]) -> None:
    """Take them off again (``-force``: one already gone does not stop the rest)."""
    await _batch([f"address del {ip}/32 dev {bridge}" for ip in ips], check=False)


async def _batch(lines: list[str], *, check: bool) -> None:
    if not lines:
        return
    fd, path = tempfile.mkstemp(prefix="dsn-scale-ip-", suffix=".batch")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        await run_command([find_tool("ip"), *([] if check else ["-force"]), "-batch", path], timeout=120.0,
                          check=check)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
