"""Traces of captures and wakes, emitted after the fact.

Layer: ``dynsnap.telemetry`` (with ``metrics.py`` the only importer of opentelemetry; above
``models``, below ``k8s``).

A capture or a wake spans many reconciles, status writes and possibly process restarts, so no
span can be open for its whole length. Each side records its steps (name and seconds, as
``OperationRecord.steps``) and, when the operation has ended, emits them here as spans with
explicit start and end times. The two processes share one trace through a W3C ``traceparent``
string only:

* the controller makes one with :func:`new_traceparent` when it asks for a capture or a wake,
  puts it on the WorkerSnapshot (``dynsnap.io/traceparent``), and when the operation is over
  emits the ROOT span itself with :func:`emit_root`: the span whose id the traceparent names,
  so a trace viewer shows one tree, not steps under a missing parent;
* the agent records the traceparent in ``lastCapture/lastWake.traceContext`` and, when the
  operation finishes, emits its steps with :func:`emit_operation` as children of that span.

Neither side keeps a span open across a restart: both only need the traceparent string.

Idempotence is the caller's: emitting the same operation twice yields two sets of spans (span
ids are random, only the root's is fixed). The agent emits once, after the status write that
records the finish succeeded, and only for a record the API server did not already hold
finished (see ``dynsnap/agent/node.py``), so an agent restart does not emit it again; a span
lost to a crash between that write and the export is lost (traces are best effort).

:func:`setup_tracing` configures the process once: an OTLP/HTTP exporter for an endpoint, a
JSON-lines file (one span per line, see :class:`JsonLinesSpanExporter`) for a path, both, or
neither, in which case every emit is a no-op.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

log = logging.getLogger(__name__)

AttrValue = str | bool | int | float
Attributes = Mapping[str, AttrValue]

# W3C Trace Context, version 00: version-traceid-parentid-flags, lower-case hex, ids not all zero.
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SAMPLED = 0x01


@dataclass(frozen=True)
class TraceParent:
    """A parsed ``traceparent``: the trace and the span that new spans become children of."""

    trace_id: int
    span_id: int
    sampled: bool = True

    @classmethod
    def parse(cls, value: str | None) -> TraceParent | None:
        """The traceparent in ``value``, or None when it is absent or not a valid version-00 one (an
        annotation anyone with write access can set: a bad one costs the trace, never the operation)."""
        if not value:
            return None
        m = _TRACEPARENT.match(value.strip())
        if m is None:
            return None
        trace_id, span_id, flags = int(m[1], 16), int(m[2], 16), int(m[3], 16)
        if trace_id == 0 or span_id == 0:
            return None
        return cls(trace_id, span_id, bool(flags & _SAMPLED))

    def __str__(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{_SAMPLED if self.sampled else 0:02x}"


def new_traceparent() -> str:
    """A new sampled trace and the id of its root span, as a W3C ``traceparent`` string."""
    trace_id = span_id = 0
    while trace_id == 0:
        trace_id = secrets.randbits(128)
    while span_id == 0:
        span_id = secrets.randbits(64)
    return str(TraceParent(trace_id, span_id))


def parse_traceparent(value: str | None) -> TraceParent | None:
    return TraceParent.parse(value)


def unix_nanos(t: datetime) -> int:
    """``t`` in nanoseconds since the epoch, exactly (a float of nanoseconds loses ~200 ns). A naive
    datetime is taken as UTC, as the models' times are."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return (t - _EPOCH) // timedelta(microseconds=1) * 1000


class _PresetIdGenerator(RandomIdGenerator):
    """Random ids, except while :meth:`preset` holds: then the next root span gets the preset trace
    id and span id. That is how :func:`emit_root` gives the root span the id a traceparent made
    earlier (maybe by another process) already names."""

    def __init__(self) -> None:
        self._preset: ContextVar[tuple[int, int] | None] = ContextVar("dynsnap_preset_ids", default=None)

    def preset(self, trace_id: int, span_id: int) -> Any:
        return self._preset.set((trace_id, span_id))

    def reset(self, token: Any) -> None:
        self._preset.reset(token)

    def generate_trace_id(self) -> int:
        preset = self._preset.get()
        return preset[0] if preset is not None else super().generate_trace_id()

    def generate_span_id(self) -> int:
        preset = self._preset.get()
        if preset is not None:
            self._preset.set(None)  # one span only, even if the caller forgets to reset
            return preset[1]
        return super().generate_span_id()


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the JSON object :class:`JsonLinesSpanExporter` writes on a line."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent
    service = span.resource.attributes.get("service.name") if span.resource is not None else None
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_unix_nano": span.start_time,
        "end_unix_nano": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "service": service,
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span to a file as one JSON object per line: ``name``, ``trace_id``
    (32 hex digits), ``span_id`` (16), ``parent_span_id`` (16, or null for a root), ``start_unix_nano``,
    ``end_unix_nano``, ``attributes``, ``status`` (``code``: OK, ERROR or UNSET; ``description``) and
    ``service``. The tests and ``dynsnap demo`` read it (:func:`read_spans`); it needs no collector."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(span_record(s), sort_keys=True) + "\n" for s in spans)
        try:
            with self._lock, self.path.open("a", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            log.warning("cannot write spans to %s: %s", self.path, e)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans a :class:`JsonLinesSpanExporter` wrote to ``path`` (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def otlp_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for an endpoint given as the collector's base URL (as
    OTEL_EXPORTER_OTLP_ENDPOINT is: ``http://collector:4318``) or already as the full URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class Tracing:
    """One process's tracing: a TracerProvider with its exporters, or nothing (every emit a no-op).

    Built by :func:`setup_tracing`; its methods are what the module-level functions call.
    """

    def __init__(self, service_name: str, exporters: Sequence[tuple[SpanExporter, bool]] = ()) -> None:
        """``exporters``: (exporter, batched). A batched one exports from a background thread (a network
        exporter must not hold up the event loop); an unbatched one as each span ends."""
        self.service_name = service_name
        self._ids = _PresetIdGenerator()
        self._lock = threading.Lock()
        self.provider: TracerProvider | None = None
        if exporters:
            provider = TracerProvider(resource=Resource.create({"service.name": service_name}), id_generator=self._ids)
            for exporter, batched in exporters:
                provider.add_span_processor(BatchSpanProcessor(exporter) if batched else SimpleSpanProcessor(exporter))
            self.provider = provider

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def _tracer(self) -> trace_api.Tracer:
        assert self.provider is not None
        return self.provider.get_tracer("dynsnap")

    def emit_root(self, traceparent: str, name: str, *, started: datetime, finished: datetime,
                  attributes: Attributes | None = None, ok: bool = True, error: str | None = None) -> None:
        """The span ``traceparent`` names, from ``started`` to ``finished``: the root of the trace the
        other spans of the operation (emitted before or after, by any process) are children of."""
        tp = TraceParent.parse(traceparent)
        if self.provider is None or tp is None or not tp.sampled:
            return  # an unsampled trace's other spans are dropped too (the SDK's parent-based sampling)
        self._root(tp, name, unix_nanos(started), unix_nanos(finished), attributes=attributes, ok=ok, error=error)

    def _root(self, tp: TraceParent, name: str, start: int, end: int, *, attributes: Attributes | None, ok: bool,
              error: str | None) -> None:
        end = max(end, start)
        with self._lock:  # the preset must meet this span's id generation, not another thread's
            token = self._ids.preset(tp.trace_id, tp.span_id)
            try:
                span = self._tracer().start_span(name, context=Context(), attributes=dict(attributes or {}),
                                                 start_time=start)
            finally:
                self._ids.reset(token)
        _end(span, end, ok=ok, error=error)

    def emit_operation(self, traceparent: str | None, name: str, started: datetime,
                       steps: Sequence[tuple[str, float]], *, attributes: Attributes | None = None, ok: bool = True,
                       error: str | None = None, failed_step: str | None = None) -> str | None:
        """One span per step, laid end to end from ``started`` (step i starts where step i-1 ends; the
        records keep durations only, so time between steps is not shown), each a child of the span
        ``traceparent`` names. Span names are ``<name>.<step>``; attributes are ``attributes`` plus
        ``dynsnap.operation``, ``dynsnap.step`` and ``dynsnap.step.index``. When not ``ok`` the failed
        step's span (the last one named ``failed_step``, else the last one) has status ERROR with
        ``error``; the others OK.

        Without a (valid) traceparent the operation gets a trace of its own, whose root span (``name``,
        over all steps) is emitted here too. Returns the traceparent the spans joined (None when
        tracing is off)."""
        if self.provider is None:
            return None
        attrs = dict(attributes or {})
        tp = TraceParent.parse(traceparent)
        start = unix_nanos(started)
        durations = [max(round(seconds * 1e9), 0) for _, seconds in steps]
        if tp is None:
            tp = TraceParent.parse(new_traceparent())
            assert tp is not None
            self._root(tp, name, start, start + sum(durations), attributes=attrs, ok=ok, error=error)
        parent = trace_api.set_span_in_context(NonRecordingSpan(SpanContext(
            tp.trace_id, tp.span_id, is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED if tp.sampled else TraceFlags.DEFAULT))))
        names = [step for step, _ in steps]
        failed = -1
        if not ok and names:
            failed = len(names) - 1 - names[::-1].index(failed_step) if failed_step in names else len(names) - 1
        tracer = self._tracer()
        t = start
        for i, (step, nanos) in enumerate(zip(names, durations, strict=True)):
            span = tracer.start_span(f"{name}.{step}", context=parent, start_time=t, attributes={
                **attrs, "dynsnap.operation": name, "dynsnap.step": step, "dynsnap.step.index": i})
            _end(span, t + nanos, ok=i != failed, error=error if i == failed else None)
            t += nanos
        return str(tp)

    def flush(self, timeout_millis: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_millis) if self.provider is not None else True

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


def _end(span: trace_api.Span, end: int, *, ok: bool, error: str | None) -> None:
    span.set_status(Status(StatusCode.OK) if ok else Status(StatusCode.ERROR, error or "failed"))
    span.end(end_time=end)


_current = Tracing("dynsnap")


def setup_tracing(service_name: str, *, otlp_endpoint: str | None = None, trace_file: Path | None = None) -> Tracing:
    """Configure this process's tracing (replacing, and shutting down, an earlier configuration):
    OTLP/HTTP to ``otlp_endpoint`` (batched, from a background thread), JSON lines to ``trace_file``
    (written as each span ends), both, or, with neither, nothing. Returns the configuration, which
    the module-level functions use from now on."""
    global _current
    exporters: list[tuple[SpanExporter, bool]] = []
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporters.append((OTLPSpanExporter(endpoint=otlp_traces_url(otlp_endpoint)), True))
    if trace_file is not None:
        exporters.append((JsonLinesSpanExporter(trace_file), False))
    _current.shutdown()
    _current = Tracing(service_name, exporters)
    if exporters:
        log.info("tracing as %s: %s", service_name, ", ".join(
            x for x in (otlp_endpoint and f"OTLP {otlp_traces_url(otlp_endpoint)}",
                        trace_file and f"file {trace_file}") if x))
    return _current


def current() -> Tracing:
    """The configuration :func:`setup_tracing` made (a no-op one before any)."""
    return _current


def shutdown_tracing() -> None:
    """Export what is pending and stop; emits after this are no-ops."""
    _current.shutdown()


def emit_root(traceparent: str, name: str, *, started: datetime, finished: datetime,
              attributes: Attributes | None = None, ok: bool = True, error: str | None = None) -> None:
    """:meth:`Tracing.emit_root` of the current configuration."""
    _current.emit_root(traceparent, name, started=started, finished=finished, attributes=attributes, ok=ok,
                       error=error)


def emit_operation(traceparent: str | None, name: str, started: datetime, steps: Sequence[tuple[str, float]], *,
                   attributes: Attributes | None = None, ok: bool = True, error: str | None = None,
                   failed_step: str | None = None) -> str | None:
    """:meth:`Tracing.emit_operation` of the current configuration."""
    return _current.emit_operation(traceparent, name, started, steps, attributes=attributes, ok=ok, error=error,
                                   failed_step=failed_step)
