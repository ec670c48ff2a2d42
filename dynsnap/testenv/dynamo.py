"""Dynamo on the local environment, whatever runs it: a client for the frontend that sends plain and
pinned chat completions and reports which worker answered, and the model's name. The graphs themselves
are real_graph.py's (pods of the real node).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from dynsnap.models import protocol as P
from dynsnap.models.dynamo import worker_ids_from
from dynsnap.testenv.cluster import wait_for

MODEL_NAME = "tiny"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def uncoloured(log: str) -> str:
    """A Dynamo process's log without the ANSI colour codes its tracing output carries (a pod's log as
    kubelet keeps it), so that its ``key=value`` fields can be matched."""
    return _ANSI.sub("", log)


@dataclass
class ChatResult:
    status: int
    worker_id: int | None
    prefill_worker_id: int | None
    text: str
    body: Any


class HasIP(Protocol):
    """A pod with an IP (real_graph.NodePod, a pod the real node runs)."""

    @property
    def ip(self) -> str: ...


class FrontendClient:
    """Chat completions through the Dynamo frontend at its pod IP."""

    def __init__(self, frontend: HasIP, *, timeout: float = 30.0) -> None:
        self.base = f"http://{frontend.ip}:{P.DYNAMO_FRONTEND_PORT}"
        self.http = httpx.AsyncClient(timeout=timeout)

    async def close(self) -> None:
        await self.http.aclose()

    async def model_listed(self) -> bool:
        try:
            r = await self.http.get(f"{self.base}/v1/models")
        except httpx.TransportError:
            # Not listening yet: a wait can begin before the frontend's process is up.
            return False
        return r.status_code == 200 and any(m.get("id") == MODEL_NAME for m in r.json().get("data", []))

    async def wait_model(self, *, timeout: float = 60) -> None:
        await wait_for(f"model {MODEL_NAME} listed by the frontend", self.model_listed, timeout=timeout)

    async def wait_routable(self, worker_id: int, *, prefill_id: int | None = None, timeout: float = 60) -> None:
        """Wait until the frontend routes a request pinned to ``worker_id`` to it. Discovery is
        eventually consistent: the model can be listed (through one worker) before the frontend
        has seen another worker's endpoint and DWM."""
        async def routed() -> bool:
            res = await self.chat("are you there?", worker_id=worker_id, prefill_id=prefill_id, max_tokens=1)
            return res.status == 200 and res.worker_id == worker_id
        await wait_for(f"frontend routing to worker {worker_id}", routed, timeout=timeout)

    async def chat(self, prompt: str = "Hello!", *, worker_id: int | None = None, prefill_id: int | None = None,
                   max_tokens: int = 8, request_id: str | None = None) -> ChatResult:
        """One chat completion; ``request_id`` is sent as ``x-request-id``, which the frontend logs the
        request under (how a failed request's own account is found in its log)."""
        headers = {}
        if request_id is not None:
            headers["x-request-id"] = request_id
        if worker_id is not None:
            headers[P.HEADER_WORKER_INSTANCE_ID] = str(worker_id)  # decimal: hex is silently ignored
        if prefill_id is not None:
            headers[P.HEADER_PREFILL_INSTANCE_ID] = str(prefill_id)
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": False, "nvext": {"extra_fields": ["worker_id"]}}
        r = await self.http.post(f"{self.base}/v1/chat/completions", json=body, headers=headers)
        data: Any = None
        with contextlib.suppress(ValueError):
            data = r.json()
        wid, pid = worker_ids_from(data)
        text = ""
        with contextlib.suppress(Exception):
            text = data["choices"][0]["message"]["content"]
        return ChatResult(r.status_code, wid, pid, text, data)
