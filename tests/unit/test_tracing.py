"""Traces emitted after the fact (dynsnap/telemetry/tracing.py): an operation's steps become spans
laid end to end under the span a traceparent names; the root span is emitted with exactly the id
that traceparent names, so controller and agent spans form one tree; OTLP/HTTP carries the same
ids to a collector; without configuration nothing is emitted."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from dynsnap.telemetry import tracing as T

STARTED = datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)
STEPS = [("quiesce", 0.25), ("save", 1.5), ("settle-suspended", 0.0314)]


@pytest.fixture
def trace_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "spans.jsonl"
    T.setup_tracing("dynsnap-test", trace_file=path)
    yield path
    T.setup_tracing("dynsnap-test")  # back to no-op for the next test


def test_traceparent_round_trip_and_refusals() -> None:
    tp = T.new_traceparent()
    parsed = T.parse_traceparent(tp)
    assert parsed is not None and parsed.sampled and str(parsed) == tp
    assert tp != T.new_traceparent()
    for bad in ("", "garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"):
        assert T.parse_traceparent(bad) is None, bad


def test_emit_operation_one_span_per_step_under_the_traceparent(trace_file: Path) -> None:
    tp = T.new_traceparent()
    parent = T.parse_traceparent(tp)
    assert parent is not None
    joined = T.emit_operation(tp, "capture", STARTED, STEPS, attributes={"k8s.pod.name": "w-0"}, ok=True)
    assert joined == tp
    spans = T.read_spans(trace_file)
    assert [s["name"] for s in spans] == ["capture.quiesce", "capture.save", "capture.settle-suspended"]
    assert [s["attributes"]["dynsnap.step"] for s in spans] == [n for n, _ in STEPS]
    assert all(s["trace_id"] == f"{parent.trace_id:032x}" for s in spans)
    assert all(s["parent_span_id"] == f"{parent.span_id:016x}" for s in spans)
    assert len({s["span_id"] for s in spans} | {f"{parent.span_id:016x}"}) == 4
    assert all(s["attributes"]["k8s.pod.name"] == "w-0" and s["service"] == "dynsnap-test" for s in spans)
    assert all(s["status"]["code"] == "OK" for s in spans)
    # Laid end to end from the start, each as long as its step took, to the nanosecond.
    assert spans[0]["start_unix_nano"] == T.unix_nanos(STARTED)
    for a, b in itertools.pairwise(spans):
        assert a["end_unix_nano"] == b["start_unix_nano"]
    for s, (_, seconds) in zip(spans, STEPS, strict=True):
        assert s["end_unix_nano"] - s["start_unix_nano"] == round(seconds * 1e9)


def test_a_failed_operation_marks_its_failed_step(trace_file: Path) -> None:
    steps = [("wake", 0.1), ("restore", 2.0), ("resume", 0.0), ("cleanup", 0.2)]
    T.emit_operation(T.new_traceparent(), "wake", STARTED, steps, ok=False, error="CriuRestoreFailed: pid taken",
                     failed_step="resume")
    status = {s["attributes"]["dynsnap.step"]: s["status"] for s in T.read_spans(trace_file)}
    assert status["resume"] == {"code": "ERROR", "description": "CriuRestoreFailed: pid taken"}
    assert all(status[n]["code"] == "OK" for n in ("wake", "restore", "cleanup"))


def test_root_span_has_the_id_the_traceparent_names(trace_file: Path) -> None:
    """The controller emits the root after the agent emitted its steps (another process, only the
    string in common): the file holds one tree, rooted at a span that really exists."""
    tp = T.new_traceparent()
    parent = T.parse_traceparent(tp)
    assert parent is not None
    T.emit_operation(tp, "capture", STARTED + timedelta(seconds=2), STEPS)
    T.emit_root(tp, "controller.capture", started=STARTED, finished=STARTED + timedelta(seconds=10),
                attributes={"dynsnap.worker": "ns/w-0"})
    spans = T.read_spans(trace_file)
    roots = [s for s in spans if s["parent_span_id"] is None]
    assert len(roots) == 1
    root = roots[0]
    assert root["name"] == "controller.capture"
    assert root["trace_id"] == f"{parent.trace_id:032x}" and root["span_id"] == f"{parent.span_id:016x}"
    assert root["end_unix_nano"] - root["start_unix_nano"] == 10 * 10**9
    assert {s["parent_span_id"] for s in spans if s is not root} == {root["span_id"]}
    # The preset id was for that one span: the next spans get ids of their own again.
    T.emit_operation(tp, "wake", STARTED, [("wake", 0.1)])
    assert T.read_spans(trace_file)[-1]["span_id"] != root["span_id"]


def test_without_a_traceparent_the_operation_roots_its_own_trace(trace_file: Path) -> None:
    joined = T.emit_operation(None, "capture", STARTED, STEPS, ok=True)
    parsed = T.parse_traceparent(joined)
    assert parsed is not None
    spans = T.read_spans(trace_file)
    root = next(s for s in spans if s["parent_span_id"] is None)
    assert root["name"] == "capture" and root["span_id"] == f"{parsed.span_id:016x}"
    children = [s for s in spans if s is not root]
    assert [s["attributes"]["dynsnap.step"] for s in children] == [n for n, _ in STEPS]
    assert {s["parent_span_id"] for s in children} == {root["span_id"]}
    assert root["start_unix_nano"] == children[0]["start_unix_nano"]
    assert root["end_unix_nano"] == children[-1]["end_unix_nano"]


def test_an_unsampled_traceparent_emits_nothing(trace_file: Path) -> None:
    tp = T.new_traceparent()[:-2] + "00"
    T.emit_operation(tp, "capture", STARTED, STEPS)
    T.emit_root(tp, "controller.capture", started=STARTED, finished=STARTED)
    assert T.read_spans(trace_file) == []


def test_unconfigured_is_a_no_op(tmp_path: Path) -> None:
    tracing = T.setup_tracing("dynsnap-test")
    assert not tracing.enabled
    assert T.emit_operation(T.new_traceparent(), "capture", STARTED, STEPS) is None
    T.emit_root(T.new_traceparent(), "controller.capture", started=STARTED, finished=STARTED)
    assert list(tmp_path.iterdir()) == []


class _Collector(BaseHTTPRequestHandler):
    """Plays an OpenTelemetry collector's OTLP/HTTP receiver: keeps each export's body."""

    bodies: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


async def test_otlp_http_carries_the_same_tree_to_a_collector() -> None:
    _Collector.bodies = []
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        tracing = T.setup_tracing("dynsnap-agent", otlp_endpoint=f"http://127.0.0.1:{server.server_port}")
        tp = T.new_traceparent()
        parent = T.parse_traceparent(tp)
        assert parent is not None
        T.emit_root(tp, "controller.wake", started=STARTED, finished=STARTED + timedelta(seconds=3))
        T.emit_operation(tp, "wake", STARTED, [("wake", 0.1), ("resume", 0.2), ("settle-active", 0.0)])
        assert await asyncio.to_thread(tracing.flush)
        T.shutdown_tracing()
    finally:
        server.shutdown()
        thread.join(10)
        T.setup_tracing("dynsnap-test")
    spans = []
    for path, body in _Collector.bodies:
        assert path == "/v1/traces"
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
            assert service == "dynsnap-agent"
            spans += [s for ss in rs.scope_spans for s in ss.spans]
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"controller.wake", "wake.wake", "wake.resume", "wake.settle-active"}
    root = by_name.pop("controller.wake")
    assert int.from_bytes(root.trace_id) == parent.trace_id and int.from_bytes(root.span_id) == parent.span_id
    assert root.parent_span_id == b""
    assert all(s.trace_id == root.trace_id and s.parent_span_id == root.span_id for s in by_name.values())
