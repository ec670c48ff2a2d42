"""The agent's side of an engine's own sleep routes (tier ``engine``), served on the worker's Dynamo
system port as ``POST /engine/<route>`` (Dynamo 1.6.1: ``runtime.register_engine_route``):

==========  ==========================================  ==========================================
engine      sleep                                       wake
==========  ==========================================  ==========================================
vLLM        ``control/sleep`` ``{"level": N}``          ``control/wake_up`` ``{}``
TRT-LLM     ``control/release_memory_occupation`` {}    ``control/resume_memory_occupation`` {}
==========  ==========================================  ==========================================

Both answer HTTP 200 with ``{"status": "ok" | "error", "message": ...}``; a route the worker does not
have is HTTP 404. Both unregister the endpoint instance from discovery before they sleep, drain what
is in flight, then free the memory; both register it again after the wake; both are idempotent (a
sleep of a sleeping engine is "already sleeping", a wake of an awake one "already awake").

A call goes to each set in turn until one is not 404 (a route a worker lacks changes nothing), so
which set a worker has needs no record. Before a capture the routes are found by a wake (harmless on
an awake engine: "already awake"), never by a GET: Dynamo's system server calls an engine route's
handler whatever the method (a GET of ``control/sleep`` put the stand-in engine to sleep; seen here),
so a probe may only call a route whose call changes nothing.

Every call has a bound (``timeout``); a connection that could not be made is tried again within it
(tenacity, capped by attempts and time); an answer that is an error is never retried here (the
agent's backoff decides). Failures are named:

    EngineRouteError     the engine answered {"status": "error"} (or not JSON, or another status)
    EngineRouteTimeout   no answer within the bound
    EngineRoutesMissing  neither route set exists on this worker (404 for each)

Layer: ``dynsnap.agent`` (I/O: HTTP to the worker's own system port, on its pod IP).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential

from dynsnap.runtime.bounded_http import ExchangeError, exchange


@dataclass(frozen=True)
class RouteSet:
    engine: str
    sleep: str
    wake: str
    takes_level: bool  # the sleep body carries {"level": N}


ROUTE_SETS: Final = (
    RouteSet("vllm", "control/sleep", "control/wake_up", takes_level=True),
    RouteSet("trtllm", "control/release_memory_occupation", "control/resume_memory_occupation", takes_level=False),
)
# An answer body is at most this many bytes kept for a message (an engine's error can be a traceback).
_MESSAGE_MAX = 2000


# An engine's answer to a sleep or wake route is a small JSON object; one past this is no engine's.
ROUTE_ANSWER_MAX_BYTES = 1 << 20


def _never_connected(e: BaseException) -> bool:
    return isinstance(e, ExchangeError) and isinstance(e.__cause__, httpx.ConnectError)


class EngineRouteError(RuntimeError):
    """The engine answered its route with an error."""


class EngineRouteTimeout(RuntimeError):
    """The engine did not answer its route within the bound."""


class EngineRoutesMissing(LookupError):
    """The worker's engine has none of the route sets."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any] | None
    text: str

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.body is not None and self.body.get("status") == "ok"

    @property
    def message(self) -> str:
        if self.body is not None and isinstance(self.body.get("message"), str):
            return str(self.body["message"])[:_MESSAGE_MAX]
        return self.text[:_MESSAGE_MAX]


@dataclass
class EngineRoutes:
    """The sleep routes of one worker: ``base`` is ``http://<pod ip>:<system port>``."""

    base: str
    timeout: float
    connect_attempts: int = 3

    async def _post(self, route: str, body: dict[str, Any], *, timeout: float | None = None) -> Answer:
        bound = timeout if timeout is not None else self.timeout
        url = f"{self.base}/engine/{route}"

        async def once() -> Answer:
            async with httpx.AsyncClient(timeout=bound, trust_env=False) as http:
                r = await exchange(http, "POST", url, json=body, deadline=bound, max_bytes=ROUTE_ANSWER_MAX_BYTES)
            try:
                data = r.json()
            except ValueError:
                data = None
            return Answer(r.status, data if isinstance(data, dict) else None, r.text)

        try:
            async with asyncio.timeout(bound):
                # Only a connection that was never made is tried again: a request the engine may have
                # received is not sent twice by this layer.
                async for attempt in AsyncRetrying(
                        retry=retry_if_exception(_never_connected), reraise=True,
                        stop=stop_after_attempt(self.connect_attempts) | stop_after_delay(bound),
                        wait=wait_exponential(multiplier=0.1, max=1.0)):
                    with attempt:
                        return await once()
        except TimeoutError as e:
            raise EngineRouteTimeout(f"POST {url}: no answer within {bound:g} s") from e
        except ExchangeError as e:
            if e.cause == "deadline" or isinstance(e.__cause__, httpx.TimeoutException):
                raise EngineRouteTimeout(f"POST {url}: no answer within {bound:g} s") from e
            raise EngineRouteError(str(e)) from e
        raise EngineRouteError(f"POST {url}: not sent")  # pragma: no cover - the loop returns or raises

    async def sleep(self, *, level: int) -> tuple[RouteSet, str]:
        """Sleep the engine through the first route set it has (a set it lacks answers 404, which
        changes nothing); the set and the engine's message."""
        return await self._first(lambda rs: (rs.sleep, {"level": level} if rs.takes_level else {}))

    async def wake(self) -> tuple[RouteSet, str]:
        """Wake the engine through the first route set it has. On an awake engine this changes nothing
        ("already awake"): it is also how a worker's routes are found before a capture."""
        return await self._first(lambda rs: (rs.wake, {}))

    async def _first(self, pick: Callable[[RouteSet], tuple[str, dict[str, Any]]]) -> tuple[RouteSet, str]:
        for rs in ROUTE_SETS:
            route, body = pick(rs)
            a = await self._post(route, body)
            if a.status == 404:
                continue
            if not a.ok:
                raise EngineRouteError(f"{rs.engine} {route} answered HTTP {a.status}: {a.message}")
            return rs, a.message
        raise EngineRoutesMissing(f"{self.base}/engine/ has none of the engine sleep routes ("
                                  + "; ".join(f"{rs.engine}: {rs.sleep}, {rs.wake}" for rs in ROUTE_SETS)
                                  + "): each answered 404")
