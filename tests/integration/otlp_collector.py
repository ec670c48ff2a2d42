"""An OTLP/HTTP trace receiver for tests whose dynsnap runs in pods: what an OpenTelemetry collector
is to a user's cluster, reduced to ``POST /v1/traces`` (protobuf, as opentelemetry's OTLP/HTTP
exporter sends it), each span kept in the form ``dynsnap.telemetry.tracing.span_record`` gives (the
JSON-lines exporter's), so a test reads both the same way. It listens on the host's address on the
run's bridge (the pods reach it there), decodes with ``opentelemetry-proto``, answers an empty
``ExportTraceServiceResponse``, and refuses what it cannot decode (400), keeping a count.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

# opentelemetry.proto.trace.v1.Status.StatusCode, named as the SDK's StatusCode enum is.
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
MAX_BODY = 16 << 20  # no exporter batch here comes near it


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def spans_of(req: ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """The spans of one export request, each as ``span_record`` writes it."""
    out = []
    for rs in req.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), None)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({
                    "name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex() or None,
                    "start_unix_nano": s.start_time_unix_nano, "end_unix_nano": s.end_time_unix_nano,
                    "attributes": {a.key: _value(a.value) for a in s.attributes},
                    "status": {"code": _STATUS.get(s.status.code, str(s.status.code)),
                               "description": s.status.message or None},
                    "service": service,
                })
    return out


@dataclass
class Collector:
    host: str
    port: int = 0
    spans: list[dict[str, Any]] = field(default_factory=list)
    refused: int = 0  # requests that were not an ExportTraceServiceRequest
    _runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        """The base URL, as a user gives ``otlpEndpoint`` (the exporter appends ``/v1/traces``)."""
        return f"http://{self.host}:{self.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        try:
            req.ParseFromString(await request.read())
        except Exception as e:  # protobuf's DecodeError, or a body over MAX_BODY
            self.refused += 1
            return web.Response(status=400, text=f"not an ExportTraceServiceRequest: {e}")
        self.spans += spans_of(req)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the port the kernel gave (port 0 asked for one)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@contextlib.asynccontextmanager
async def collecting(host: str) -> AsyncIterator[Collector]:
    c = Collector(host)
    await c.start()
    try:
        yield c
    finally:
        await c.stop()
