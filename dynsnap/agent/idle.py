"""Idle facts at the edge: the agent scrapes its own workers' Dynamo metrics
(``http://<pod IP>:9090/metrics``: in-flight requests and the request counters) and turns
successive samples into ``status.idle`` (``lastActivity``, ``idleSince``), changed only when
they change, so a quiet fleet writes nothing and a busy worker at most once per granularity.

Layer: ``dynsnap.agent``. :func:`parse_metrics` and :func:`advance` are pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx

from dynsnap.models.workersnapshot import IdleFacts
from dynsnap.runtime.bounded_http import ExchangeError, exchange
from dynsnap.telemetry import promtext

# Dynamo 1.6.1 worker metrics (its system port). In-flight is a gauge per endpoint; requests a
# counter per endpoint. Every series of the worker is summed: the worker is idle only when all are.
INFLIGHT = "dynamo_component_inflight_requests"
REQUESTS = "dynamo_component_requests_total"


@dataclass(frozen=True)
class Sample:
    inflight: int
    requests: float


class MetricsUnavailable(RuntimeError):
    """The worker's metrics could not be read, or lack the series idle is measured by. ``cause``: the bound
    the exchange passed (``deadline``, ``size``), ``transport``, or None (an answer, not a worker's page)."""

    def __init__(self, message: str, *, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def parse_metrics(text: str) -> Sample:
    """Sum of the in-flight gauge and of the request counter over all their series (read by
    ``dynsnap.telemetry.promtext``: NaN, infinite and negative values are left out)."""
    found = promtext.samples(text, (INFLIGHT, REQUESTS))
    inflight = promtext.total(found, INFLIGHT)
    if inflight is None:
        raise MetricsUnavailable(f"the worker's metrics have no {INFLIGHT} series")
    return Sample(inflight=int(inflight), requests=promtext.total(found, REQUESTS) or 0.0)


# A worker's metrics page is tens of KiB (Dynamo 1.6.1's mocker: 9 KiB); a page past this is no worker's.
METRICS_MAX_BYTES = 4 << 20


async def scrape(url: str, *, timeout: float = 3.0) -> Sample:
    """The worker's sample, the whole GET within ``timeout`` and its page at most METRICS_MAX_BYTES
    (runtime.bounded_http); MetricsUnavailable otherwise, naming which bound it passed."""
    try:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
            r = await exchange(http, "GET", url, deadline=timeout, max_bytes=METRICS_MAX_BYTES)
    except ExchangeError as e:
        raise MetricsUnavailable(f"cannot read {url}: {e}", cause=e.cause) from e
    if r.status != 200:
        raise MetricsUnavailable(f"{url} answered {r.status}")
    return parse_metrics(r.text)


def advance(prev: IdleFacts | None, sample: Sample, *, now: datetime, granularity: float) -> IdleFacts | None:
    """The idle facts after ``sample``, or None when nothing worth writing changed.

    Activity is in-flight above 0 or the request counter moving (a counter that went down is a
    restarted worker: activity too). ``idleSince`` is set when the worker becomes quiet (to its
    last activity when known), cleared by activity. A busy worker's ``lastActivity`` is rewritten
    only when the one written is older than ``granularity`` seconds.
    """
    prev = prev or IdleFacts()
    moved = prev.requests_total is None or sample.requests != prev.requests_total
    first = prev.requests_total is None
    active = sample.inflight > 0 or (moved and not first)
    if active:
        stale = prev.last_activity is None or now - prev.last_activity >= timedelta(seconds=granularity)
        if prev.idle_since is None and not stale:
            return None
        return IdleFacts(inflight=sample.inflight, requests_total=sample.requests, last_activity=now, idle_since=None)
    if prev.idle_since is not None:
        return None  # quiet, and already said so
    return IdleFacts(inflight=sample.inflight, requests_total=sample.requests,
                     last_activity=prev.last_activity, idle_since=prev.last_activity or now)
