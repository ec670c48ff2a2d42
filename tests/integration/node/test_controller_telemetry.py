"""Every step explained, across the chart's pods: a capture and a wake each make one trace whose root
span the controller emits (from its decision to the end: captured, or verified) and whose children
are the controller's own steps (quiesce, verify) and the agent's steps, joined through the
traceparent on the WorkerSnapshot, all sent by OTLP/HTTP to the collector the chart's
``otlpEndpoint`` names (otlp_collector.py, as a user's collector); and the controller's /metrics, at
its pod's ``health`` port, count what happened (the counts read before and after: the install is the
package's, so earlier tests' counts are in them too)."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest
from controllerenv import asleep, get_ws, policy, set_override, verified_after, wait_ws
from otlp_collector import Collector
from realnodeenv import WORKER_COMPONENT, Env, component_policy, deployed

from dynsnap.k8s.client import Obj
from dynsnap.models import resources as R
from dynsnap.telemetry.tracing import TraceParent
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for

pytestmark = pytest.mark.cluster


def graph(env: Env) -> Obj:
    body = chart_node.example_body(env, name="otel", worker_replicas=2, speedup_ratio=1, policy=policy(
        enabled=True, idle_after="2s", tier="snapshot"))
    return component_policy(body, WORKER_COMPONENT, policy(min_active=1))


def _trace(spans: list[Obj], traceparent: str) -> tuple[Obj, list[Obj]]:
    tp = TraceParent.parse(traceparent)
    assert tp is not None
    mine = [s for s in spans if int(s["trace_id"], 16) == tp.trace_id]
    roots = [s for s in mine if s["parent_span_id"] is None]
    assert len(roots) == 1 and int(roots[0]["span_id"], 16) == tp.span_id, roots
    children = [s for s in mine if s["parent_span_id"] is not None]
    assert all(int(s["parent_span_id"], 16) == tp.span_id for s in children), children
    return roots[0], children


async def _arrived(otlp: Collector, traceparent: str, want: Callable[[list[Obj]], bool]) -> list[Obj]:
    """The spans, once the trace of ``traceparent`` has what ``want`` asks (the exporters batch: a
    span reaches the collector seconds after it ends)."""
    tp = TraceParent.parse(traceparent)
    assert tp is not None

    async def probe() -> list[Obj] | None:
        mine = [s for s in otlp.spans if int(s["trace_id"], 16) == tp.trace_id]
        return list(otlp.spans) if want(mine) else None
    return await wait_for(f"the spans of trace {traceparent}", probe, timeout=60, interval=0.5)


async def _metrics(env: Env) -> Callable[[str], float]:
    (ctl,) = await env.chart_pods("controller")
    port = next(p["containerPort"] for c in ctl["spec"]["containers"] for p in c.get("ports") or []
                if p.get("name") == "health")
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        r = await http.get(f"http://{ctl['status']['podIP']}:{port}/metrics")
    assert r.status_code == 200, r.text[:200]
    text = r.text

    def value(series: str) -> float:
        found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0
    return value


OK_CAPTURE = 'dynsnap_operations_total{operation="capture",result="ok",tier="snapshot"}'
OK_WAKE = 'dynsnap_operations_total{operation="wake",result="ok",tier="snapshot"}'
VERIFIED = 'dynsnap_verify_duration_seconds_count{result="verified"}'
RECONCILES = 'dynsnap_reconciles_total{controller="controller",result="done"}'
PATCHES = 'dynsnap_api_requests_total{verb="PATCH"}'


async def test_capture_and_wake_are_one_trace_each_sent_to_the_collector_and_counted(env: Env, otlp: Collector
                                                                                     ) -> None:
    before = await _metrics(env)
    async with deployed(env, graph(env)) as g:
        async def one_asleep() -> Obj | None:
            for p in g.workers(WORKER_COMPONENT):
                if asleep(await get_ws(env.api, p)):
                    return {"pod": p}
            return None
        pod = (await wait_for("one worker asleep", one_asleep, timeout=120, interval=0.5))["pod"]
        ws = await wait_ws(env, pod, "capture traced", lambda w: bool(
            w and (w["status"]["controller"].get("traced") or [])), timeout=30)
        since = (ws["status"].get("lastWake") or {}).get("id")
        await set_override(env.api, pod, "active")
        ws = await wait_ws(env, pod, "woken and verified", verified_after(since), timeout=90)
        st = ws["status"]
        # The capture: the controller's quiesce record and the agent's capture record name one trace.
        q, cap = st["controller"]["quiesce"], st["lastCapture"]
        assert q["traceContext"] == cap["traceContext"]
        spans = await _arrived(otlp, q["traceContext"], lambda mine: any(
            s["parent_span_id"] is None for s in mine) and {s["service"] for s in mine} == {
            "dynsnap-controller", "dynsnap-agent"} and len(mine) > len(q["steps"]) + len(cap["steps"]))
        root, children = _trace(spans, q["traceContext"])
        assert root["name"] == "dynsnap.capture" and root["service"] == "dynsnap-controller"
        names = [s["name"] for s in children]
        assert [n for n in names if n.startswith("controller.quiesce.")] == [
            f"controller.quiesce.{s['name']}" for s in q["steps"]]
        assert [n for n in names if n.startswith("capture.")] == [f"capture.{s['name']}" for s in cap["steps"]]
        assert {s["service"] for s in children} == {"dynsnap-controller", "dynsnap-agent"}
        # The wake: the controller's wake record, the agent's wake record and the verification.
        w, wake = st["controller"]["wake"], st["lastWake"]
        assert w["traceContext"] == wake["traceContext"] and w["ok"] is True
        spans = await _arrived(otlp, w["traceContext"], lambda mine: any(
            s["parent_span_id"] is None for s in mine) and any(
            s["name"] == "controller.verify.pinned-requests" for s in mine) and sum(
            s["name"].startswith("wake.") for s in mine) == len(wake["steps"]))
        root, children = _trace(spans, w["traceContext"])
        assert root["name"] == "dynsnap.wake" and root["status"]["code"] != "ERROR"
        names = [s["name"] for s in children]
        assert [n for n in names if n.startswith("wake.")] == [f"wake.{s['name']}" for s in wake["steps"]]
        assert "controller.verify.pinned-requests" in names
        assert otlp.refused == 0
        # Metrics, from the controller pod's health port: this graph's capture, wake and verification.
        after = await _metrics(env)
        for series in (OK_CAPTURE, OK_WAKE, VERIFIED):
            assert after(series) >= before(series) + 1, (series, before(series), after(series))
        async def every_worker() -> bool:  # this graph's two and the long sleep's (earlier graphs' gone with them)
            now = await _metrics(env)
            managed = len((await env.api.list(R.WORKER_SNAPSHOTS))["items"])
            return managed >= 2 and now('dynsnap_workers{state="Suspended"}') + now(
                'dynsnap_workers{state="Active"}') == managed
        await wait_for("dynsnap_workers counting every worker the controller manages", every_worker, timeout=30,
                       interval=1)
        for series in (RECONCILES, PATCHES):
            assert after(series) > before(series), series
