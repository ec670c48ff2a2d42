"""Every step explained (issue 9), by the chart's agent on the real node: each finished capture and wake
of a worker of examples/dgd/agg.yaml is one span per step, sent by OTLP/HTTP to the collector the chart's
``agent.otlpEndpoint`` names (the package's ``otlp``, otlp_collector.py), in the trace the
WorkerSnapshot's ``dynsnap.io/traceparent`` names (children of the span it names, the steps those of
``status.lastCapture/lastWake.steps``, laid end to end from the record's start), that traceparent
recorded in ``traceContext``; without one, the agent roots a trace of its own; a failed capture's
failing step carries the failure's reason. The agent pod's ``/metrics`` (its health port) counts and
times them and shows the node's workers by state. Moved from the sandbox suite test_agent_traces.py.

The controller always sets a traceparent, so the module scales the chart's controller to 0 once its
graph serves (realnodeenv.scale_controller) and writes the worker's WorkerSnapshot itself, with and
without one, playing the controller (the serving gate too); back to 1 after. The traces across the
chart's pods with the controller are node/test_controller_telemetry.py.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import pytest
from otlp_collector import Collector
from prometheus_client.parser import text_string_to_metric_families
from realnodecycle import state_is, wait_ws
from realnodeenv import WORKER_COMPONENT, Env, scale_controller

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.telemetry.tracing import new_traceparent, parse_traceparent, unix_nanos
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.dynsnap_parts import ws_body
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

CUDA_ERROR_OUT_OF_MEMORY = 2
SUSPEND = (("tier", "suspend"),)
Series = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class Traced:
    env: Env
    otlp: Collector
    pod: NodePod


@pytest.fixture(scope="module")
async def traced(env: Env, otlp: Collector) -> AsyncIterator[Traced]:
    body = chart_node.example_body(env, name="trc", worker_replicas=1, policy={"dynsnap.io/tier": "suspend"})
    graph = await chart_node.deploy_example(env, body)
    pod = graph.workers(WORKER_COMPONENT)[0]
    try:
        await scale_controller(env, 0)
        # The controller's WorkerSnapshot goes; each test writes its own, as the controller would.
        await env.api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
        yield Traced(env, otlp, pod)
    except BaseException:
        print(await chart_node.graph_logs(env, graph))
        raise
    finally:
        chart_node.keep_pod_logs(env)
        await real_graph.teardown(env.api, graph)
        env.graphs.remove(graph)
        await scale_controller(env, 1)


async def gate(t: Traced, serving: bool) -> None:
    await t.env.cluster.set_serving_gate(t.pod, serving)
    await t.env.cluster.wait_ready(t.pod.namespace, t.pod.name, ready=serving, timeout=60)


async def set_desired(t: Traced, desired: str) -> None:
    await t.env.api.merge_patch(R.WORKER_SNAPSHOTS, t.pod.name, {"spec": {"desiredState": desired}},
                                namespace=t.pod.namespace)


async def create(t: Traced, annotations: dict[str, str] | None = None) -> None:
    body = ws_body(t.pod, tier="suspend")  # type: ignore[arg-type]  # name, namespace, node and UID
    if annotations:
        body["metadata"]["annotations"] = annotations
    await t.env.api.create(R.WORKER_SNAPSHOTS, body)
    await wait_ws(t.env, t.pod, "Accepted, Active", state_is("Active"), timeout=120)


async def capture(t: Traced) -> Obj:
    await gate(t, False)
    await set_desired(t, "Suspended")
    return await wait_ws(t.env, t.pod, "Suspended", state_is("Suspended", suspended=True), timeout=120)


async def wake(t: Traced) -> Obj:
    await set_desired(t, "Active")
    ws = await wait_ws(t.env, t.pod, "Active", state_is("Active", suspended=False), timeout=120)
    await gate(t, True)
    return ws


async def finish(t: Traced) -> None:
    """Best-effort end of a test: no fault left, Active wanted, in serving, the WorkerSnapshot deleted."""
    t.env.driver.clear_faults()
    with contextlib.suppress(NotFound, TimeoutError):
        await set_desired(t, "Active")
        await wait_ws(t.env, t.pod, "Active", state_is("Active"), timeout=60)
    with contextlib.suppress(Exception):
        await gate(t, True)
    with contextlib.suppress(NotFound):
        await t.env.api.delete(R.WORKER_SNAPSHOTS, t.pod.name, namespace=t.pod.namespace)


async def step_spans(t: Traced, rec: Obj) -> list[dict[str, Any]]:
    """The spans of the operation ``rec`` records, one per step, once the collector has them all (the
    exporter sends in batches)."""
    def mine() -> list[dict[str, Any]]:
        spans = [s for s in t.otlp.spans
                 if s["attributes"].get("dynsnap.operation.id") == rec["id"] and "dynsnap.step" in s["attributes"]]
        return sorted(spans, key=lambda s: int(s["attributes"]["dynsnap.step.index"]))

    async def arrived() -> list[dict[str, Any]] | None:
        spans = mine()
        return spans if len(spans) >= len(rec["steps"]) else None
    spans: list[dict[str, Any]] = await wait_for(f"the spans of operation {rec['id']}", arrived, timeout=60,
                                                 interval=0.5)
    return spans


def assert_steps_as_spans(spans: list[dict[str, Any]], rec: Obj, operation: str, *, trace_id: str,
                          parent: str) -> None:
    names = [s["name"] for s in rec["steps"]]
    assert [s["attributes"]["dynsnap.step"] for s in spans] == names, (spans, rec)
    assert [s["name"] for s in spans] == [f"{operation}.{n}" for n in names]
    assert all(s["trace_id"] == trace_id and s["parent_span_id"] == parent for s in spans), spans
    assert all(s["service"] == "dynsnap-agent" for s in spans)
    # Laid end to end from the record's start, each as long as the record says its step took.
    assert spans[0]["start_unix_nano"] == unix_nanos(datetime.fromisoformat(rec["started"]))
    for s, step in zip(spans, rec["steps"], strict=True):
        assert s["end_unix_nano"] - s["start_unix_nano"] == round(step["seconds"] * 1e9), (s, step)
    for a, b in itertools.pairwise(spans):
        assert a["end_unix_nano"] == b["start_unix_nano"]


async def metrics(t: Traced) -> dict[Series, float]:
    """The agent pod's /metrics, on its health port at its pod IP."""
    (agent,) = [p for p in await t.env.chart_pods("agent") if not p["metadata"].get("deletionTimestamp")]
    port = next(p["containerPort"] for c in agent["spec"]["containers"] for p in c.get("ports") or []
                if p.get("name") == "health")
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        r = await http.get(f"http://{agent['status']['podIP']}:{port}/metrics")
    assert r.status_code == 200, r.text[:200]
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(r.text) for x in fam.samples}


def workers(m: dict[Series, float], state: str) -> float:
    return m.get(("dynsnap_workers", (("state", state),)), 0.0)


async def test_capture_and_wake_are_spans_of_the_trace_the_worker_snapshot_names(traced: Traced) -> None:
    """The controller's part played by the test: a traceparent on the WorkerSnapshot. Both the capture's
    and the wake's steps become its spans at the collector; the agent pod's /metrics counts and times them."""
    t = traced
    tp = new_traceparent()
    parent = parse_traceparent(tp)
    assert parent is not None
    trace_id, span_id = f"{parent.trace_id:032x}", f"{parent.span_id:016x}"
    try:
        await create(t, {P.ANN_TRACEPARENT: tp})
        before = await metrics(t)
        cap = (await capture(t))["status"]["lastCapture"]
        assert cap["ok"] is True and cap["traceContext"] == tp
        assert [s["name"] for s in cap["steps"]] == ["quiesce", "save", "settle-suspended"]
        spans = await step_spans(t, cap)
        assert_steps_as_spans(spans, cap, "capture", trace_id=trace_id, parent=span_id)
        assert all(s["attributes"]["k8s.pod.uid"] == t.pod.uid and s["attributes"]["k8s.node.name"] == t.pod.node
                   for s in spans)
        assert all(s["status"]["code"] == "OK" and s["attributes"]["dynsnap.tier"] == "suspend" for s in spans)
        asleep = await metrics(t)
        count = ("dynsnap_capture_duration_seconds_count", SUSPEND)
        assert asleep[count] == before.get(count, 0) + 1
        # The node's other workers (the package's long sleep) stay as they were: this one moved.
        assert workers(asleep, "Suspended") == workers(before, "Suspended") + 1
        assert workers(asleep, "Active") == workers(before, "Active") - 1

        woken = (await wake(t))["status"]["lastWake"]
        assert woken["ok"] is True and woken["traceContext"] == tp
        assert [s["name"] for s in woken["steps"]] == ["wake", "resume", "settle-active"]
        assert_steps_as_spans(await step_spans(t, woken), woken, "wake", trace_id=trace_id, parent=span_id)
        awake = await metrics(t)
        wakes = ("dynsnap_wake_duration_seconds_count", SUSPEND)
        assert awake[wakes] == before.get(wakes, 0) + 1
        assert (workers(awake, "Active"), workers(awake, "Suspended")) == (
            workers(before, "Active"), workers(before, "Suspended"))
        assert awake[("dynsnap_reconciles_total", (("controller", "agent"), ("result", "ok")))] >= 6
        # Its requests to the API server: the status applies (PATCH) of each step, the informers' lists.
        assert awake[("dynsnap_api_requests_total", (("verb", "PATCH"),))] >= 6
        assert awake[("dynsnap_api_requests_total", (("verb", "GET"),))] >= 2
        # Each operation sent once: the writes after the capture's finish (the whole wake) did not send
        # it again; and no root of the agent's own: the root is the controller's to send.
        assert_steps_as_spans(await step_spans(t, cap), cap, "capture", trace_id=trace_id, parent=span_id)
        assert not [s for s in t.otlp.spans if s["trace_id"] == trace_id and s["span_id"] == span_id]
        assert t.otlp.refused == 0
    finally:
        await finish(t)


async def test_without_a_traceparent_the_agent_roots_the_trace_itself(traced: Traced) -> None:
    """No controller asked (no annotation): the capture still makes one tree, rooted at a span the
    agent sent with the id its recorded traceContext names."""
    t = traced
    try:
        await create(t)
        cap = (await capture(t))["status"]["lastCapture"]
        own = parse_traceparent(cap.get("traceContext"))
        assert own is not None, cap
        trace_id, span_id = f"{own.trace_id:032x}", f"{own.span_id:016x}"
        spans = await step_spans(t, cap)
        assert_steps_as_spans(spans, cap, "capture", trace_id=trace_id, parent=span_id)

        async def root() -> list[dict[str, Any]] | None:
            return [s for s in t.otlp.spans if s["span_id"] == span_id] or None
        roots = await wait_for("the capture's root span at the collector", root, timeout=60, interval=0.5)
        assert len(roots) == 1, roots
        r = roots[0]
        assert r["name"] == "capture" and r["parent_span_id"] is None and r["trace_id"] == trace_id
        assert r["attributes"]["dynsnap.operation.id"] == cap["id"]
        assert r["start_unix_nano"] == spans[0]["start_unix_nano"]
        assert r["end_unix_nano"] == unix_nanos(datetime.fromisoformat(cap["finished"]))
        await wake(t)
    finally:
        await finish(t)


async def test_a_failed_capture_names_its_failing_step_and_reason(traced: Traced) -> None:
    """The driver refuses the checkpoint: the capture's trace shows quiesce done and save failed with
    the recorded reason (CheckpointFailed) and the driver's error; the failure is counted once."""
    t = traced
    tp = new_traceparent()
    parent = parse_traceparent(tp)
    assert parent is not None
    failed = ("dynsnap_operations_total", (("operation", "capture"), ("result", "failed"), ("tier", "suspend")))
    try:
        await create(t, {P.ANN_TRACEPARENT: tp})
        before = await metrics(t)
        t.env.driver.control(f"fail cuCheckpointProcessCheckpoint * {CUDA_ERROR_OUT_OF_MEMORY}")
        await gate(t, False)
        await set_desired(t, "Suspended")

        def capture_failed(ws: Obj | None) -> bool:
            cap = ((ws or {}).get("status") or {}).get("lastCapture") or {}
            return cap.get("ok") is False and cap.get("traceContext") == tp
        cap = (await wait_ws(t.env, t.pod, "the capture failed", capture_failed, timeout=120))["status"]["lastCapture"]
        await set_desired(t, "Active")  # no retry after the backoff
        err = cap["error"]
        assert err["reason"] == "CheckpointFailed" and err["step"] == "save", err
        assert [s["name"] for s in cap["steps"]] == ["quiesce", "save"], cap
        spans = await step_spans(t, cap)
        assert_steps_as_spans(spans, cap, "capture", trace_id=f"{parent.trace_id:032x}",
                              parent=f"{parent.span_id:016x}")
        quiesced, saved = spans
        assert quiesced["status"]["code"] == "OK"
        assert saved["status"]["code"] == "ERROR"
        assert saved["status"]["description"] == f"CheckpointFailed: {err['message']}"
        assert "CUDA_ERROR_OUT_OF_MEMORY" in saved["status"]["description"], saved
        assert all(s["attributes"]["dynsnap.error.reason"] == "CheckpointFailed" and s["attributes"]["dynsnap.ok"]
                   is False for s in spans)
        after = await metrics(t)
        assert after[failed] == before.get(failed, 0) + 1
    finally:
        await finish(t)
