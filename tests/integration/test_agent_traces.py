"""Every step explained (issue 9): the node agent, started with ``--trace-file``, emits each finished
capture and wake of a live mocker worker as one span per step, in the trace the WorkerSnapshot's
``dynsnap.io/traceparent`` names (children of the span it names, the steps those of
``status.lastCapture/lastWake.steps``, laid end to end from the record's start), records that
traceparent in ``traceContext``; without one, it roots a trace of its own; a failed capture's
failing step carries the failure's reason. Its ``/metrics`` on the health port counts and times them
and shows the workers of its node by state.

Sandbox, why: it writes WorkerSnapshots with and without a traceparent, with no controller (which
always sets one), and reads the agent's --trace-file; the traces across the chart's pods are
node/test_controller_telemetry.py.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agentenv import (
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    StubDriver,
    build_stub_driver,
    deploy_serving,
    eventually,
    install_dynsnap,
    quiesce,
    set_desired,
    state_is,
    token_kubeconfig,
    wait_ws,
    worker_component,
    ws_body,
)
from prometheus_client.parser import text_string_to_metric_families

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.telemetry.tracing import new_traceparent, parse_traceparent, read_spans, unix_nanos
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, RunningPod

pytestmark = pytest.mark.cluster

NODE = NODES[0]  # replica 0 runs there (testenv.dynamo.deploy)
CUDA_ERROR_OUT_OF_MEMORY = 2


@dataclass
class Env:
    api: Kube
    cluster: LocalCluster
    pod: RunningPod
    agent: AgentProc
    driver: StubDriver
    trace_file: Path
    health_port: int


def _free_port() -> int:
    """A port free now on this host, for the agent's health server (its --health-port 0 means none)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-traces-"))
    driver = build_stub_driver(work / "stubcuda")
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    g = await deploy_serving(cluster, D.dgd("trc", [worker_component("worker", replicas=1, driver=driver)]))
    pod = g.workers("worker")[0]
    assert pod.node == NODE
    trace_file, port = work / "spans.jsonl", _free_port()
    agent = AgentProc(NODE, kubeconfig, work / NODE, driver,
                      extra=["--trace-file", str(trace_file), "--health-port", str(port)])
    try:
        await agent.start()
        e = Env(cluster.api, cluster, pod, agent, driver, trace_file, port)
        await eventually("the agent's health server ready", lambda: _ready(e), timeout=90)
        yield e
    finally:
        await agent.stop()
        await D.teardown(cluster, g)
        shutil.rmtree(work, ignore_errors=True)


async def _wait(env: Env, what: str, check: Any, timeout: float = 120) -> Obj:
    ws: Obj = await wait_ws(env.api, env.pod, what, check, timeout=timeout, agents=[env.agent])
    return ws


async def _create(env: Env, annotations: dict[str, str] | None = None) -> None:
    body = ws_body(env.pod, tier="suspend")
    if annotations:
        body["metadata"]["annotations"] = annotations
    await env.api.create(R.WORKER_SNAPSHOTS, body)
    await _wait(env, "Accepted, Active", state_is("Active"))


async def _capture(env: Env) -> Obj:
    await quiesce(env.cluster, env.pod, serving=False)
    await set_desired(env.api, env.pod, "Suspended")
    return await _wait(env, "Suspended", state_is("Suspended", suspended=True))


async def _wake(env: Env) -> Obj:
    await set_desired(env.api, env.pod, "Active")
    ws = await _wait(env, "Active", state_is("Active", suspended=False))
    await quiesce(env.cluster, env.pod, serving=True)
    return ws


async def _finish(env: Env) -> None:
    """Best-effort end of a test: Active wanted, in serving, the WorkerSnapshot deleted, no fault left."""
    env.driver.clear_faults()
    with contextlib.suppress(NotFound):
        await set_desired(env.api, env.pod, "Active")
        with contextlib.suppress(TimeoutError):
            await _wait(env, "Active", state_is("Active"), timeout=60)
    with contextlib.suppress(Exception):
        await quiesce(env.cluster, env.pod, serving=True)
    with contextlib.suppress(NotFound):
        await env.api.delete(R.WORKER_SNAPSHOTS, env.pod.name, namespace=env.pod.namespace)


async def _step_spans(env: Env, rec: Obj) -> list[dict[str, Any]]:
    """The spans of the operation ``rec`` records, one per step once the agent has emitted them (it does
    right after the status write that records the finish, so the test may read the status first)."""
    def mine() -> list[dict[str, Any]]:
        spans = [s for s in read_spans(env.trace_file)
                 if s["attributes"].get("dynsnap.operation.id") == rec["id"] and "dynsnap.step" in s["attributes"]]
        return sorted(spans, key=lambda s: int(s["attributes"]["dynsnap.step.index"]))

    async def emitted() -> list[dict[str, Any]] | None:
        spans = mine()
        return spans if len(spans) >= len(rec["steps"]) else None
    spans: list[dict[str, Any]] = await eventually(f"the spans of operation {rec['id']}", emitted, timeout=30)
    return spans


def _assert_steps_as_spans(spans: list[dict[str, Any]], rec: Obj, operation: str, *, trace_id: str,
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


async def _ready(env: Env) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://127.0.0.1:{env.health_port}/readyz", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status == 200
    return False


async def _metrics(env: Env) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as s, \
            s.get(f"http://127.0.0.1:{env.health_port}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        assert r.status == 200
        text = await r.text()
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(text) for x in fam.samples}


SUSPEND = (("tier", "suspend"),)


async def test_capture_and_wake_are_spans_of_the_trace_the_worker_snapshot_names(env: Env) -> None:
    """The controller's part played by the test: a traceparent on the WorkerSnapshot. Both the capture's
    and the wake's steps become its spans; the agent's /metrics counts and times them."""
    tp = new_traceparent()
    parent = parse_traceparent(tp)
    assert parent is not None
    trace_id, span_id = f"{parent.trace_id:032x}", f"{parent.span_id:016x}"
    before = await _metrics(env)
    try:
        await _create(env, {P.ANN_TRACEPARENT: tp})
        cap = (await _capture(env))["status"]["lastCapture"]
        assert cap["ok"] is True and cap["traceContext"] == tp
        assert [s["name"] for s in cap["steps"]] == ["quiesce", "save", "settle-suspended"]
        spans = await _step_spans(env, cap)
        _assert_steps_as_spans(spans, cap, "capture", trace_id=trace_id, parent=span_id)
        assert all(s["attributes"]["k8s.pod.uid"] == env.pod.uid and s["attributes"]["k8s.node.name"] == NODE
                   for s in spans)
        assert all(s["status"]["code"] == "OK" and s["attributes"]["dynsnap.tier"] == "suspend" for s in spans)
        asleep = await _metrics(env)
        count = ("dynsnap_capture_duration_seconds_count", SUSPEND)
        assert asleep[count] >= 1 and asleep[count] == before.get(count, 0) + 1
        assert asleep[("dynsnap_workers", (("state", "Suspended"),))] == 1
        assert asleep[("dynsnap_workers", (("state", "Active"),))] == 0

        wake = (await _wake(env))["status"]["lastWake"]
        assert wake["ok"] is True and wake["traceContext"] == tp
        assert [s["name"] for s in wake["steps"]] == ["wake", "resume", "settle-active"]
        _assert_steps_as_spans(await _step_spans(env, wake), wake, "wake", trace_id=trace_id, parent=span_id)
        awake = await _metrics(env)
        assert awake[("dynsnap_wake_duration_seconds_count", SUSPEND)] == \
            before.get(("dynsnap_wake_duration_seconds_count", SUSPEND), 0) + 1
        assert awake[("dynsnap_workers", (("state", "Active"),))] == 1
        assert awake[("dynsnap_workers", (("state", "Suspended"),))] == 0
        assert awake[("dynsnap_reconciles_total", (("controller", "agent"), ("result", "ok")))] >= 6
        # Its requests to the API server: the status applies (PATCH) of each step, the informers' lists.
        assert awake[("dynsnap_api_requests_total", (("verb", "PATCH"),))] >= 6
        assert awake[("dynsnap_api_requests_total", (("verb", "GET"),))] >= 2
        # Each operation emitted once: the writes after the capture's finish (the whole wake) did not
        # emit it again.
        _assert_steps_as_spans(await _step_spans(env, cap), cap, "capture", trace_id=trace_id, parent=span_id)
        # The agent emitted no root of its own: the root is the controller's to emit.
        assert not [s for s in read_spans(env.trace_file) if s["trace_id"] == trace_id and s["span_id"] == span_id]
    finally:
        await _finish(env)


async def test_without_a_traceparent_the_agent_roots_the_trace_itself(env: Env) -> None:
    """No controller asked (no annotation): the capture still makes one tree, rooted at a span the
    agent emitted with the id its recorded traceContext names."""
    try:
        await _create(env)
        cap = (await _capture(env))["status"]["lastCapture"]
        own = parse_traceparent(cap.get("traceContext"))
        assert own is not None, cap
        trace_id, span_id = f"{own.trace_id:032x}", f"{own.span_id:016x}"
        spans = await _step_spans(env, cap)
        _assert_steps_as_spans(spans, cap, "capture", trace_id=trace_id, parent=span_id)
        roots = [s for s in read_spans(env.trace_file) if s["span_id"] == span_id]
        assert len(roots) == 1, roots
        root = roots[0]
        assert root["name"] == "capture" and root["parent_span_id"] is None and root["trace_id"] == trace_id
        assert root["attributes"]["dynsnap.operation.id"] == cap["id"]
        assert root["start_unix_nano"] == spans[0]["start_unix_nano"]
        assert root["end_unix_nano"] == unix_nanos(datetime.fromisoformat(cap["finished"]))
        await _wake(env)
    finally:
        await _finish(env)


async def test_a_failed_capture_names_its_failing_step_and_reason(env: Env) -> None:
    """The driver refuses the checkpoint: the capture's trace shows quiesce done and save failed with
    the recorded reason (CheckpointFailed) and the driver's error; the failure is counted."""
    tp = new_traceparent()
    parent = parse_traceparent(tp)
    assert parent is not None
    before = await _metrics(env)
    failed = ("dynsnap_operations_total", (("operation", "capture"), ("result", "failed"), ("tier", "suspend")))
    try:
        await _create(env, {P.ANN_TRACEPARENT: tp})
        env.driver.control(f"fail cuCheckpointProcessCheckpoint * {CUDA_ERROR_OUT_OF_MEMORY}")
        await quiesce(env.cluster, env.pod, serving=False)
        await set_desired(env.api, env.pod, "Suspended")

        def capture_failed(ws: Obj) -> bool:
            cap = (ws.get("status") or {}).get("lastCapture") or {}
            return cap.get("ok") is False and cap.get("traceContext") == tp
        cap = (await _wait(env, "the capture failed", capture_failed))["status"]["lastCapture"]
        await set_desired(env.api, env.pod, "Active")  # no retry after the backoff
        err = cap["error"]
        assert err["reason"] == "CheckpointFailed" and err["step"] == "save", err
        assert [s["name"] for s in cap["steps"]] == ["quiesce", "save"], cap
        spans = await _step_spans(env, cap)
        _assert_steps_as_spans(spans, cap, "capture", trace_id=f"{parent.trace_id:032x}",
                               parent=f"{parent.span_id:016x}")
        quiesced, saved = spans
        assert quiesced["status"]["code"] == "OK"
        assert saved["status"]["code"] == "ERROR"
        assert saved["status"]["description"] == f"CheckpointFailed: {err['message']}"
        assert "CUDA_ERROR_OUT_OF_MEMORY" in saved["status"]["description"], saved
        assert all(s["attributes"]["dynsnap.error.reason"] == "CheckpointFailed" and s["attributes"]["dynsnap.ok"]
                   is False for s in spans)
        after = await _metrics(env)
        assert after[failed] == before.get(failed, 0) + 1
    finally:
        await _finish(env)
