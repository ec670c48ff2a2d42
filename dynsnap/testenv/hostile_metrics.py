"""hostile_metrics: a tenant's own program that answers the node agent's ``/metrics`` scrape as a hostile
pod author would (issue 39). It stands in for no real part: it *is* the attack, run for real on the real
node, in a container beside a real Dynamo worker of its pod (the same network namespace), on the port
the agent scrapes, the worker's own system port moved to another (``--worker``).

Its answer is chosen per request by a file the test writes (``<mode dir>/<POD_NAME>``; absent or
``proxy``: the worker's own page, relayed from its real port, so the worker is idle, captured and
asleep as any other):

- ``trickle``: a status line and a Content-Length of 1 MiB (within any cap), then one byte every 0.3 s
  for as long as the client stays (the drip the issue measured: 90 s of another graph's request left
  unanswered);
- ``huge``: a 512 MiB page sent at full speed with no Content-Length (the body ends when the connection
  does), so only a reader that counts as it reads stops it (the agent went to a 4.2 GiB peak on four).

Layer: ``dynsnap.testenv``; runs as its own process under the worker image's python (``python3 -m
dynsnap.testenv.hostile_metrics``, this checkout's package on ``PYTHONPATH``), standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path

TRICKLE_EVERY = 0.3
TRICKLE_LENGTH = 1 << 20
HUGE = 512 << 20
CHUNK = b"# " + b"x" * ((1 << 20) - 3) + b"\n"  # 1 MiB of comment lines: a valid, useless page


def mode(mode_dir: Path, pod: str) -> str:
    """The answer this pod gives now (read per request, so the test can turn it at any time)."""
    try:
        return (mode_dir / pod).read_text().strip() or "proxy"
    except OSError:
        return "proxy"


async def relay(worker_port: int, path: bytes) -> bytes:
    """The worker's own answer to ``GET path`` on its real port, whole (it is the tenant's own, small)."""
    r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", worker_port), 5)
    try:
        w.write(b"GET " + path + b" HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        await w.drain()
        return await asyncio.wait_for(r.read(), 10)
    finally:
        w.close()


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, args: argparse.Namespace) -> None:
    try:
        request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/metrics"
        how = mode(args.mode_dir, args.pod) if path.startswith(b"/metrics") else "proxy"
        if how == "trickle":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: %d\r\n\r\n" % TRICKLE_LENGTH)
            for _ in range(TRICKLE_LENGTH):
                writer.write(b"#")
                await writer.drain()
                await asyncio.sleep(TRICKLE_EVERY)
        elif how == "huge":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
            for _ in range(HUGE // len(CHUNK)):
                writer.write(CHUNK)
                await writer.drain()
        else:
            writer.write(await relay(args.worker, path))
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
        pass  # the client went away (the agent's bound), or the worker did not answer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def serve(args: argparse.Namespace) -> None:
    server = await asyncio.start_server(lambda r, w: answer(r, w, args=args), "0.0.0.0", args.listen)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hostile_metrics")
    p.add_argument("--listen", type=int, required=True, help="the port the agent scrapes")
    p.add_argument("--worker", type=int, required=True, help="the worker's own system port")
    p.add_argument("--mode-dir", type=Path, required=True)
    p.add_argument("--pod", default=os.environ.get("POD_NAME", ""))
    asyncio.run(serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
