"""What the controller asks a Dynamo frontend (ai-dynamo 1.6.1), over HTTP with bounded retries:

- demand: ``/metrics`` -> ``dynamo_frontend_inflight_requests`` and ``dynamo_frontend_queued_requests``
  summed over the models it serves (gauges; DESIGN.md section 3.1: the controller scrapes only
  frontends, the agents scrape their own workers);
- the models it serves (``/v1/models``);
- a chat completion pinned to one worker (``x-dynamo-worker-instance-id``, decimal; a prefill worker
  ``x-dynamo-prefill-instance-id``), asking ``nvext.extra_fields: ["worker_id"]`` so the answer says
  which worker produced it. A pinned request never falls back (unknown id 400, quarantined 500,
  frozen 504), so an answer carrying the id is proof the worker served it.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import httpx

from dynsnap.controller.plan import Demand
from dynsnap.models import protocol as P
from dynsnap.models.dynamo import worker_ids_from
from dynsnap.models.ids import InstanceId

INFLIGHT = "dynamo_frontend_inflight_requests"
QUEUED = "dynamo_frontend_queued_requests"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


class FrontendError(RuntimeError):
    """The frontend could not be asked (connection refused, timeout, a non-metrics answer)."""


def parse_demand(text: str) -> Demand:
    """In-flight and queued requests over every model (pure). Missing series count as 0; a page
    with no frontend metric at all is not a frontend's."""
    inflight = queued = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, value = m.group(1), m.group(3)
        if name not in (INFLIGHT, QUEUED):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        seen = True
        if name == INFLIGHT:
            inflight += v
        else:
            queued += v
    # The gauges appear only once a model has been asked for; before that any dynamo_frontend_
    # series (or its HELP line) says it is a frontend's page, with nothing in flight.
    if not seen and "dynamo_frontend_" not in text:
        raise FrontendError(f"no {INFLIGHT} or {QUEUED} series, and no dynamo_frontend_ metric at all")
    return Demand(inflight=inflight, queued=queued)


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


class Frontend:
    """One client for every frontend the controller talks to (connection pool shared)."""

    def __init__(self, *, timeout: float = 10.0, attempts: int = 3) -> None:
        self.http = httpx.AsyncClient(timeout=timeout, trust_env=False)
        self.attempts = attempts

    async def close(self) -> None:
        await self.http.aclose()

    async def _get(self, url: str) -> httpx.Response:
        last: Exception | None = None
        for i in range(self.attempts):
            try:
                return await self.http.get(url)
            except httpx.HTTPError as e:
                last = e
                await asyncio.sleep(0.1 * (2 ** i))
        raise FrontendError(f"GET {url}: {type(last).__name__}: {last}")

    async def demand(self, base: str) -> Demand:
        r = await self._get(f"{base}/metrics")
        if r.status_code != 200:
            raise FrontendError(f"GET {base}/metrics: HTTP {r.status_code}")
        return parse_demand(r.text)

    async def models(self, base: str) -> list[str]:
        r = await self._get(f"{base}/v1/models")
        if r.status_code != 200:
            raise FrontendError(f"GET {base}/v1/models: HTTP {r.status_code}")
        return [str(m["id"]) for m in (r.json().get("data") or []) if isinstance(m, dict) and "id" in m]

    async def pinned(self, base: str, model: str, *, worker_id: int | None, prefill_id: int | None,
                     max_tokens: int = 4) -> PinnedAnswer:
        """One chat completion pinned to a worker. Transport errors are an answer with status 0."""
        body = {"model": model, "messages": [{"role": "user", "content": "dynsnap verify"}],
                "max_tokens": max_tokens, "stream": False, "nvext": {"extra_fields": ["worker_id"]}}
        try:
            r = await self.http.post(f"{base}/v1/chat/completions", json=body,
                                     headers=pin_headers(worker_id=worker_id, prefill_id=prefill_id))
        except httpx.HTTPError as e:
            return PinnedAnswer(0, None, None, f"{type(e).__name__}: {e}")
        if r.status_code != 200:
            return PinnedAnswer(r.status_code, None, None, r.text[:300])
        try:
            data = r.json()
        except ValueError:
            return PinnedAnswer(r.status_code, None, None, "answer is not JSON")
        decode, prefill = worker_ids_from(data)
        return PinnedAnswer(200, decode, prefill)
