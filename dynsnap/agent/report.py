"""What the agent tells the world beside status, written from the records status already holds:
the spans of a finished capture or wake (in the trace the WorkerSnapshot's ``dynsnap.io/traceparent``
names, or one of the agent's own), its outcome and duration in the metrics, the gauges of the node,
and the object an Event is about. Telemetry never fails a reconcile.

Layer: ``dynsnap.agent`` (observation: nothing here decides anything).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from dynsnap.agent.status import gpu_bytes_freed
from dynsnap.models import protocol as P
from dynsnap.models.protocol import ObservedState
from dynsnap.models.workersnapshot import OperationRecord, WorkerSnapshot, WorkerSnapshotStatus
from dynsnap.telemetry import tracing
from dynsnap.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
Obj = dict[str, Any]


def traceparent_of(ws: WorkerSnapshot) -> str | None:
    """The W3C traceparent the controller put on the WorkerSnapshot, None when absent or malformed (a
    bad annotation costs the trace, never the operation)."""
    tp = tracing.parse_traceparent(ws.metadata.annotations.get(P.ANN_TRACEPARENT))
    return str(tp) if tp is not None else None


def ws_object(ws: WorkerSnapshot) -> Obj:
    """What an Event's ``regarding`` is built from (EventRecorder never raises into a reconcile)."""
    return {"apiVersion": f"{P.DYNSNAP_GROUP}/{P.WS_VERSION}", "kind": P.WS_KIND,
            "metadata": {"name": ws.metadata.name, "namespace": ws.metadata.namespace, "uid": ws.metadata.uid,
                         "resourceVersion": ws.metadata.resource_version}}


@dataclass
class Reporter:
    """Spans and metrics of finished operations, for one agent."""

    node_name: str
    metrics: Metrics
    # traceparents this agent made for operations no controller traced: their root span is ours to emit
    own_traces: set[str] = field(default_factory=set)

    def ended(self, prior: Obj, status: WorkerSnapshotStatus) -> list[tuple[str, OperationRecord]]:
        """The captures and wakes ``status`` records as finished that ``prior`` (the status the API server
        holds) does not: reported once that write succeeds, so each is reported once, also across agent
        restarts (a record the server holds finished was reported by whoever wrote it). One no
        controller traced gets a trace of its own, recorded with it."""
        out = []
        for operation, rec, was in (("capture", status.last_capture, prior.get("lastCapture")),
                                    ("wake", status.last_wake, prior.get("lastWake"))):
            if rec is None or rec.finished is None:
                continue
            if isinstance(was, dict) and was.get("id") == rec.id and was.get("finished"):
                continue
            if rec.trace_context is None and tracing.current().enabled:
                rec.trace_context = tracing.new_traceparent()
                self.own_traces.add(rec.trace_context)
            out.append((operation, rec))
        return out

    def report(self, ws: WorkerSnapshot, operation: str, rec: OperationRecord) -> None:
        """A finished capture or wake: its steps as spans, its outcome and duration in the metrics."""
        err = rec.error
        attrs: dict[str, str | int | float | bool] = {
            "k8s.namespace.name": ws.metadata.namespace or "", "k8s.pod.name": ws.spec.pod_name,
            "k8s.pod.uid": ws.spec.pod_uid, "k8s.node.name": self.node_name,
            "dynsnap.tier": rec.tier.value, "dynsnap.operation.id": rec.id, "dynsnap.ok": bool(rec.ok)}
        if err is not None:
            attrs["dynsnap.error.reason"] = err.reason.value
        error = f"{err.reason.value}: {err.message}" if err is not None else None
        try:
            if rec.trace_context in self.own_traces:
                self.own_traces.discard(rec.trace_context)
                assert rec.trace_context is not None and rec.finished is not None
                tracing.emit_root(rec.trace_context, operation, started=rec.started, finished=rec.finished,
                                  attributes=attrs, ok=bool(rec.ok), error=error)
            tracing.emit_operation(rec.trace_context, operation, rec.started, [(s.name, s.seconds) for s in rec.steps],
                                   attributes=attrs, ok=bool(rec.ok), error=error,
                                   failed_step=err.step if err is not None else None)
        except Exception:
            log.exception("%s: emitting the spans of %s %s", ws.key, operation, rec.id)
        seconds = (rec.finished - rec.started).total_seconds() if rec.finished is not None else None
        self.metrics.operation_finished("capture" if operation == "capture" else "wake", rec.tier.value,
                                        ok=bool(rec.ok), seconds=seconds)

    def node_gauges(self, statuses: list[Obj], queue_depth: int) -> None:
        """The gauges that describe this node now: queue depth, workers by state, GPU memory freed."""
        self.metrics.set_queue_depth("agent", queue_depth)
        counts: dict[str, int] = {}
        freed = 0
        for st in statuses:
            state = str(st.get("state") or ObservedState.UNKNOWN.value)
            counts[state] = counts.get(state, 0) + 1
            if state == ObservedState.SUSPENDED.value:
                freed += gpu_bytes_freed(st.get("lastCapture"))
        self.metrics.set_workers(counts)
        self.metrics.set_gpu_bytes_freed(freed)
