"""Every step explained, across processes: a capture and a wake each make one trace whose root
span the controller emits (from its decision to the end: captured, or verified) and whose
children are the controller's own steps (quiesce, verify) and the agent's steps, joined through
the traceparent on the WorkerSnapshot; the controller's /metrics count what happened."""

from __future__ import annotations

import re

import httpx
import pytest
from controllerenv import asleep, get_ws, policy, running, verified_after, wait_ws

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.telemetry.tracing import TraceParent, read_spans
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.dynsnap_parts import StubDriver

pytestmark = pytest.mark.cluster


def make(driver: StubDriver) -> Obj:
    worker = D.mocker_component("worker", replicas=2, dynsnap=True, env={"LD_PRELOAD": str(driver.libcuda)})
    worker["annotations"] = policy(enabled=True, idle_after="2s", tier="snapshot", min_active=1)
    return D.dgd("otel", [D.frontend_component(), worker])


def _trace(spans: list[Obj], traceparent: str) -> tuple[Obj, list[Obj]]:
    tp = TraceParent.parse(traceparent)
    assert tp is not None
    mine = [s for s in spans if int(s["trace_id"], 16) == tp.trace_id]
    roots = [s for s in mine if s["parent_span_id"] is None]
    assert len(roots) == 1 and int(roots[0]["span_id"], 16) == tp.span_id, roots
    children = [s for s in mine if s["parent_span_id"] is not None]
    assert all(int(s["parent_span_id"], 16) == tp.span_id for s in children), children
    return roots[0], children


async def test_capture_and_wake_are_one_trace_each_and_counted(cluster: LocalCluster, tmp_path_factory:
                                                               pytest.TempPathFactory) -> None:
    spans_dir = tmp_path_factory.mktemp("spans")
    ctl_trace = spans_dir / "controller.jsonl"
    async with running(cluster, make, controller_args=["--trace-file", str(ctl_trace)],
                       agent_args=["--trace-file", str(spans_dir / "agent-{node}.jsonl")]) as env:
        async def one_asleep() -> Obj | None:
            for p in env.graph.workers("worker"):
                if asleep(await get_ws(env.api, p)):
                    return {"pod": p}
            return None
        pod = (await wait_for("one worker asleep", one_asleep, timeout=120, interval=0.5))["pod"]
        ws = await wait_ws(env, pod, "capture traced", lambda w: bool(
            w and (w["status"]["controller"].get("traced") or [])), timeout=30)
        since = (ws["status"].get("lastWake") or {}).get("id")
        await env.api.merge_patch(R.PODS, pod.name, {"metadata": {"annotations": {P.ANN_DESIRED_STATE: "active"}}},
                                  namespace=pod.namespace)
        ws = await wait_ws(env, pod, "woken and verified", verified_after(since), timeout=90)
        st = ws["status"]
        spans = read_spans(ctl_trace)
        for f in spans_dir.glob("agent-*.jsonl"):
            spans += read_spans(f)
        # The capture: the controller's quiesce record and the agent's capture record name one trace.
        q, cap = st["controller"]["quiesce"], st["lastCapture"]
        assert q["traceContext"] == cap["traceContext"]
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
        root, children = _trace(spans, w["traceContext"])
        assert root["name"] == "dynsnap.wake" and root["status"]["code"] != "ERROR"
        names = [s["name"] for s in children]
        assert [n for n in names if n.startswith("wake.")] == [f"wake.{s['name']}" for s in wake["steps"]]
        assert "controller.verify.pinned-requests" in names
        # Metrics, from the port the controller announced.
        m = re.search(r"/metrics on port (\d+)", env.controller.tail(400))
        assert m, env.controller.tail(40)
        async with httpx.AsyncClient(trust_env=False) as http:
            text = (await http.get(f"http://127.0.0.1:{m.group(1)}/metrics")).text
        def value(series: str) -> float:
            found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
            return float(found.group(1)) if found else 0.0
        assert value('dynsnap_verify_duration_seconds_count{result="verified"}') >= 1
        assert value('dynsnap_operations_total{operation="capture",result="ok",tier="snapshot"}') >= 1
        assert value('dynsnap_operations_total{operation="wake",result="ok",tier="snapshot"}') >= 1
        assert value('dynsnap_workers{state="Suspended"}') + value('dynsnap_workers{state="Active"}') == 2
        assert value('dynsnap_reconciles_total{controller="controller",result="done"}') > 0
        assert value('dynsnap_api_requests_total{verb="PATCH"}') > 0
