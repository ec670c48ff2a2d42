"""One HTTP exchange with something a tenant runs, bounded as a whole: a total deadline over connect, send,
headers and the whole body, and a cap on the body's size (counted as it arrives, decoded, so a compressed
answer cannot grow past it). httpx's own ``timeout`` bounds each read, not the exchange: a body sent a byte
every 0.4 s ran past ``timeout=1.0`` for as long as it lasted; and ``response.text`` reads whatever size
comes. Every call the agent and the controller make to a worker or a frontend goes through
:func:`exchange`; past either bound it is a named :class:`ExchangeError` (``cause`` ``deadline`` or
``size``) for that one exchange, never a hang or a process grown by a pod's answer.

Layer: ``dynsnap.runtime`` (generic; the agent and the controller build on it).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Literal

import httpx

Cause = Literal["deadline", "size", "transport"]


class ExchangeError(Exception):
    """The exchange did not complete within its bounds (``deadline``, ``size``) or at all (``transport``)."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause: Cause = cause


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: httpx.Headers

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return json.loads(self.body)


async def exchange(client: httpx.AsyncClient, method: str, url: str, *, deadline: float, max_bytes: int,
                   **kwargs: Any) -> Answer:
    """``method url`` through ``client`` (its pool, its per-read timeout), the whole of it within ``deadline``
    seconds and its body at most ``max_bytes``. ExchangeError otherwise; nothing of a larger body is kept."""
    try:
        async with asyncio.timeout(deadline):
            async with client.stream(method, url, **kwargs) as r:
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise ExchangeError("size", f"{method} {url}: Content-Length {declared} is over the "
                                                f"{max_bytes} bytes an answer may have")
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise ExchangeError("size", f"{method} {url}: the answer passed the {max_bytes} bytes "
                                                    "an answer may have")
                return Answer(r.status_code, bytes(body), r.headers)
    except TimeoutError as e:
        raise ExchangeError("deadline", f"{method} {url}: no whole answer within {deadline:g} s") from e
    except httpx.HTTPError as e:
        raise ExchangeError("transport", f"{method} {url}: {type(e).__name__}: {e}") from e
