"""Telemetry of a capture and a wake, emitted from the controller's record once the operation ended:
the controller's spans (its steps, timed in the record), the trace's root span and the metrics.
Steps span reconciles and restarts, so nothing is emitted while they happen; each operation's spans
are emitted once (``status.controller.traced``, written with the status that follows).

Layer: ``dynsnap.controller`` (observation: reads the record, decides nothing).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from dynsnap.models.workersnapshot import ControllerRecord, Verification, WorkerSnapshot
from dynsnap.telemetry import tracing
from dynsnap.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


def traced(rec: ControllerRecord, op_id: str) -> bool:
    """Mark ``op_id``'s spans as emitted; False if they already were."""
    if op_id in rec.traced:
        return False
    rec.traced = [*rec.traced, op_id][-8:]
    return True


def close_capture(metrics: Metrics | None, ws: WorkerSnapshot, rec: ControllerRecord) -> bool:
    """Once the agent has finished the capture this quiesce led to: the controller's quiesce spans, the
    trace's root span (quiesce start -> captured) and the capture's metrics. False when there is
    nothing (yet, or any more) to emit."""
    q, cap = rec.quiesce, ws.status.last_capture
    if q is None or cap is None or cap.finished is None or cap.started < q.started or not traced(rec, q.id):
        return False
    tp = q.trace_context
    attrs = {"dynsnap.pod": ws.spec.pod_name, "dynsnap.namespace": ws.metadata.namespace or "",
             "dynsnap.tier": cap.tier.value}
    try:
        tracing.emit_operation(tp, "controller.quiesce", q.started, [(s.name, s.seconds) for s in q.steps],
                               attributes=attrs)
        if tp:
            tracing.emit_root(tp, "dynsnap.capture", started=q.started, finished=cap.finished, attributes=attrs,
                              ok=bool(cap.ok), error=cap.error.message if cap.error else None)
    except Exception:
        log.exception("capture spans not emitted")
    if metrics is not None:
        metrics.operation_finished("capture", cap.tier.value, ok=bool(cap.ok),
                                   seconds=(cap.finished - q.started).total_seconds())
    return True


def close_wake(metrics: Metrics | None, ws: WorkerSnapshot, rec: ControllerRecord, v: Verification) -> None:
    """A verification ended: its spans and the wake's root span (wake request -> verified or failed) in
    the wake's trace, the metrics, and the wake record closed with the verdict."""
    finished = v.finished or datetime.now(UTC)
    result = "verified" if v.ok else (v.reason.value if v.reason else "failed")
    if metrics is not None:
        metrics.observe_verify(result, (finished - v.started).total_seconds())
    w = rec.wake
    if w is None or w.finished is not None:
        return
    w.finished, w.ok = finished, bool(v.ok)
    if not traced(rec, w.id):
        return
    attrs = {"dynsnap.pod": ws.spec.pod_name, "dynsnap.namespace": ws.metadata.namespace or "",
             "dynsnap.tier": w.tier.value, "dynsnap.verify.result": result}
    try:
        tracing.emit_operation(w.trace_context, "controller.verify", v.started,
                               [(s.name, s.seconds) for s in v.steps], attributes=attrs, ok=bool(v.ok),
                               error=None if v.ok else v.message)
        if w.trace_context:
            tracing.emit_root(w.trace_context, "dynsnap.wake", started=w.started, finished=finished,
                              attributes=attrs, ok=bool(v.ok), error=None if v.ok else v.message)
    except Exception:
        log.exception("wake spans not emitted")
    if metrics is not None:
        metrics.operation_finished("wake", w.tier.value, ok=bool(v.ok),
                                   seconds=(finished - w.started).total_seconds())
