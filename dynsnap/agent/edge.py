"""Wake on request, at the edge: the agent watches each worker of its node that sleeps routable
(tier suspend, ``spec.routable``: its pod still Ready, its endpoint and registration kept) for a
request that reached it, and has it woken at once.

The signal is the worker's own in-flight gauge on its Dynamo system port
(``dynamo_component_inflight_requests``, the same page the idle facts come from): a suspended
worker's CPU side keeps answering it while the request itself waits in the worker's CUDA calls
(DESIGN.md section 2: 1-2 ms answers, the gauge at 1 from the first second, on the H200). It is read
every ``routable_poll_interval`` (50 ms), so a request is seen within about that, not at the idle
scrape's 10 s. What is seen goes to the reconcile (``on_request``): the wake is the agent's own
(``trigger: request`` in its record), and the controller is told by the status, not asked.

Only routable sleepers are polled, each by a loop of its own (one GET per interval, the whole of it
bounded in time and size: runtime.bounded_http), so one sleeper's slow or huge answers delay no
other's; a worker that does not answer is asked again at its next interval (it wakes nothing).

Layer: ``dynsnap.agent`` (I/O: HTTP to the workers' own system ports).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from dynsnap.agent.idle import METRICS_MAX_BYTES, MetricsUnavailable, parse_metrics
from dynsnap.models import protocol as P
from dynsnap.models.protocol import DesiredState, ObservedState
from dynsnap.runtime.bounded_http import ExchangeError, exchange

log = logging.getLogger(__name__)
Obj = dict[str, Any]
MAX_SLEEPERS = 256  # sleepers watched at once: a node has a few routable sleepers, never thousands


@dataclass(frozen=True)
class Sleeper:
    key: str  # namespace/name of its WorkerSnapshot
    url: str  # its /metrics


def routable_sleepers(snapshots: Iterable[Obj], pod_ip: Callable[[str, str], str | None], *, port: int
                      ) -> list[Sleeper]:
    """The WorkerSnapshots of workers asleep routable, with where their metrics are (pure)."""
    out = []
    for ws in snapshots:
        spec, st = ws.get("spec") or {}, ws.get("status") or {}
        if not spec.get("routable") or spec.get("desiredState") != DesiredState.SUSPENDED.value:
            continue
        if st.get("state") != ObservedState.SUSPENDED.value:
            continue
        sus: Obj = next((c for c in st.get("conditions") or [] if c.get("type") == P.ConditionType.SUSPENDED.value),
                        {})
        if sus.get("reason") != P.Reason.ROUTABLE.value:
            continue
        meta = ws["metadata"]
        ip = pod_ip(meta["namespace"], spec.get("podName") or meta["name"])
        if ip:
            out.append(Sleeper(f"{meta['namespace']}/{meta['name']}", f"http://{ip}:{port}/metrics"))
    return out


async def inflight(http: httpx.AsyncClient, url: str, *, timeout: float) -> int | None:
    """The worker's in-flight requests, summed over its series as the idle facts read them
    (``idle.parse_metrics``); None when it did not answer (a transport error) or its page has no in-flight
    series. An answer past ``timeout`` or over ``idle.METRICS_MAX_BYTES`` raises runtime.bounded_http's
    ExchangeError (cause ``deadline``, ``size``): the watch says it, once per episode."""
    try:
        r = await exchange(http, "GET", url, deadline=timeout, max_bytes=METRICS_MAX_BYTES)
    except ExchangeError as e:
        if e.cause in ("deadline", "size"):
            raise
        return None
    if r.status != 200:
        return None
    try:
        return parse_metrics(r.text).inflight
    except MetricsUnavailable:
        return None


async def watch(sleepers: Callable[[], list[Sleeper]], on_request: Callable[[str], None], *, interval: float,
                stop: asyncio.Event, timeout: float = 1.0,
                on_unbounded: Callable[[str, ExchangeError], None] | None = None) -> None:
    """Until ``stop``: each routable sleeper watched by a loop of its own, its in-flight gauge every ``interval``
    seconds, each look bounded as a whole by ``timeout``; one above 0 is passed to ``on_request`` (once per
    sleep: the reconcile wakes it and it leaves the list). A sleeper whose answers trickle or swell delays its
    own looks only, never another's (before, one round waited for every sleeper's answer), and is passed to
    ``on_unbounded`` once per episode (the first such answer after a good one). The list is read again every
    ``interval``: a sleeper that left it (woken, gone) has its loop ended."""
    seen: set[str] = set()
    loops: dict[str, tuple[Sleeper, asyncio.Task[None]]] = {}

    async def look(http: httpx.AsyncClient, s: Sleeper) -> None:
        said: str | None = None
        while not stop.is_set():
            try:
                n = await inflight(http, s.url, timeout=timeout)
                said = None
            except ExchangeError as e:
                n = None
                if said != e.cause and on_unbounded is not None:
                    on_unbounded(s.key, e)
                said = e.cause
            if n and n > 0:
                seen.add(s.key)
                log.info("%s: %g request(s) reached it asleep routable: waking it", s.key, n)
                on_request(s.key)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    # A connection per sleeper at most, never a pool slot waited for: one sleeper's slow answer holds its own.
    limits = httpx.Limits(max_connections=MAX_SLEEPERS, max_keepalive_connections=MAX_SLEEPERS)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False, limits=limits) as http:
        def start(s: Sleeper) -> asyncio.Task[None]:
            return asyncio.create_task(look(http, s), name=f"wake-on-request {s.key}")
        try:
            while not stop.is_set():
                now = {s.key: s for s in sleepers()[:MAX_SLEEPERS]}
                seen.intersection_update(now)  # one that woke (or went) is watched afresh next time
                for key, (s, task) in list(loops.items()):
                    if now.get(key) != s or task.done():
                        task.cancel()
                        del loops[key]
                for key, s in now.items():
                    if key not in loops and key not in seen:
                        loops[key] = (s, start(s))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)
        finally:
            for _, task in loops.values():
                task.cancel()
            await asyncio.gather(*(task for _, task in loops.values()), return_exceptions=True)
