"""The quiesce before a capture waits for each of its conditions itself; none stands in for another.
A worker taken out of serving (its ``dynsnap.io/serving`` gate False) is captured only once the
controller's own view shows its EndpointSlice endpoint not ready *and* the frontend refuses a request
pinned to it (it no longer routes there) *and* nothing is in flight. Two of them are made to lag:

- the controller's view of EndpointSlices (its watch silenced by fake_apiproxy): the endpoint is not
  ready and the frontend has stopped routing to the worker, but the controller cannot see the first,
  so the quiesce is called off at ``--quiesce-timeout`` (``WorkerServing``), never captured;
- the frontend's view (its link to the API server held by fake_held_link): the endpoint is not ready,
  but the frontend still routes to the worker, and a pinned request is answered by it, so the quiesce
  is called off too.

And the frontend's answer must be its explicit refusal of that instance (issue 18: fail closed):

- the frontend unavailable mid-quiesce (its processes stopped, so the pinned request times out):
  no answer is no refusal, nothing is captured, and the quiesce is called off at its deadline.

Once the view catches up, the next quiesce passes all its steps and the worker is captured. The
capture is asked for by hand (``dynsnap.io/desired-state: suspended``) with a serving peer, so
min-active allows it and nothing else decides. Each quiesce is counted: the worker's Quiescing
Event's ``series.count`` (or its Events) is the number of quiesces it went through.

Sandbox, why: the controller's and the frontend's links to the API server go through fake_apiproxy
and fake_held_link on 127.0.0.1, which pods of the real node cannot reach; not yet moved.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from controllerenv import CtlEnv, asleep, events_for, get_ws, history, policy, running, verified_after
from fake_held_link import HeldLink

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.runtime import procfs
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynsnap_parts import StubDriver
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault

pytestmark = pytest.mark.cluster

QUIESCE_TIMEOUT = 8
ALL_STEPS = ["gate", "endpoint-not-ready", "frontend-stopped-routing", "drained"]


def graph(name: str, frontend_kubeconfig: Path | None = None) -> Any:
    def make(driver: StubDriver) -> Obj:
        fe = D.frontend_component()
        if frontend_kubeconfig is not None:  # the frontend's own way to the API server
            fe["extraPodSpec"]["mainContainer"]["env"] = [{"name": "KUBECONFIG", "value": str(frontend_kubeconfig)}]
        worker = D.mocker_component("worker", replicas=2, dynsnap=True, speedup_ratio=1,
                                    env={"LD_PRELOAD": str(driver.libcuda)})
        worker["annotations"] = policy(min_active=1, verify_requests=1)
        body = D.dgd(name, [fe, worker])
        # Idleness puts nobody to sleep within the test: only the manual suspend does.
        body["metadata"]["annotations"] = policy(enabled=True, idle_after="1h", tier="suspend")
        return body
    return make


async def suspend_by_hand(env: CtlEnv, pod: RunningPod) -> None:
    """What ``dynsnap suspend POD`` writes (here as the test's admin)."""
    await env.api.merge_patch(R.PODS, pod.name, {"metadata": {"annotations": {P.ANN_DESIRED_STATE: "suspended"}}},
                              namespace=pod.namespace)


def quiesce_of(ws: Obj | None) -> Obj:
    return (((ws or {}).get("status") or {}).get("controller") or {}).get("quiesce") or {}


async def called_off(wss: list[Obj]) -> Obj:
    """The first WorkerSnapshot version whose quiesce ended without a capture."""
    async def found() -> Obj | None:
        return next((ws for ws in wss if quiesce_of(ws).get("ok") is False), None)
    ws: Obj = await wait_for("the quiesce called off", found, timeout=QUIESCE_TIMEOUT + 60, interval=0.2)
    return ws


async def endpoint_ready(env: CtlEnv, pod: RunningPod) -> bool | None:
    ep = await env.cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")
    return None if ep is None else bool(ep["conditions"].get("ready"))


async def assert_called_off(env: CtlEnv, pod: RunningPod, wss: list[Obj], steps: list[str]) -> None:
    ws = await called_off(wss)
    q = quiesce_of(ws)
    assert [s["name"] for s in q["steps"]] == steps, q
    assert not [v for v in wss if v["spec"]["desiredState"] == "Suspended"], "a capture was asked for"
    warned = [e for e in await events_for(env.api, pod.namespace, pod.name)
              if e["type"] == "Warning" and e["reason"] == "WorkerServing"]
    assert warned and f"quiesce did not finish in {QUIESCE_TIMEOUT}s; capture called off" in warned[-1]["note"]


async def captured_after_all_steps(env: CtlEnv, pod: RunningPod) -> None:
    """Once the view caught up: the next quiesce passes every step and the worker is captured."""
    async def slept() -> Obj | None:
        ws = await get_ws(env.api, pod)
        return ws if asleep(ws) else None
    ws: Obj = await wait_for(f"{pod.name} captured", slept, timeout=180, interval=0.5)
    q = quiesce_of(ws)
    assert q.get("ok") is True and [s["name"] for s in q["steps"]] == ALL_STEPS, q


async def test_no_capture_while_the_controller_still_sees_the_endpoint_ready(cluster: LocalCluster) -> None:
    assert cluster.cp is not None
    async with FakeApiProxy.in_front_of(cluster.cp) as proxy, running(
            cluster, graph("quiesce-slices"), controller_server=proxy.url,
            controller_args=["--quiesce-timeout", str(QUIESCE_TIMEOUT)]) as env:
        pod, _peer = env.graph.workers("worker")
        wid = instance_id_from_dwm(await env.api.get(R.DWMS, pod.name, namespace=pod.namespace))
        # The controller's view of EndpointSlices first catches up with both endpoints ready (as the API
        # server has them), then stops there: its connections are cut, its next watch is answered 410
        # (so it lists afresh) and the one after goes silent.
        for p in env.graph.workers("worker"):
            await wait_for(f"{p.name}'s endpoint ready", lambda p=p: endpoint_ready(env, p), timeout=60)
        proxy.add(Fault("respond", path_contains="/endpointslices", watch=True, status=410))
        proxy.add(Fault("silent_after", path_contains="/endpointslices", watch=True, times=None))
        proxy.abort_all()

        async def silenced() -> bool:
            return any(s.fault == "silent_after" for s in proxy.seen(path_contains="/endpointslices", watch=True))
        await wait_for("the controller's EndpointSlice watch relisted, then silenced", silenced, timeout=60)

        async with history(env.api, R.WORKER_SNAPSHOTS, pod) as wss:
            await suspend_by_hand(env, pod)
            await called_off(wss)
            # The world moved on: the endpoint is not ready and the frontend refuses it. Only the
            # controller's view lags, and a capture waits for that view. (The EndpointSlice
            # controller follows the gate in its own time: under load, once in CI, not yet within
            # the quiesce timeout; so awaited, bounded.)
            async def not_ready() -> bool:
                return await endpoint_ready(env, pod) is False
            assert await wait_for("the endpoint not ready", not_ready, timeout=30, interval=0.2)
            # The frontend follows the EndpointSlice in its own time too (its watch, then its
            # router's instance list): once in CI it still answered 200 right after the endpoint
            # turned not ready. Its refusal is awaited, bounded, and asserted.
            async def refused() -> bool:
                return (await env.fe.chat("routed?", worker_id=wid, max_tokens=1)).status == 400
            assert await wait_for("the frontend refusing the worker", refused, timeout=30, interval=0.2)
            await assert_called_off(env, pod, wss, ["gate"])

        proxy.clear()
        proxy.abort_all()  # the controller watches again, unsilenced, from where it was
        await captured_after_all_steps(env, pod)


async def test_no_capture_while_the_frontend_still_routes_to_the_worker(cluster: LocalCluster) -> None:
    assert cluster.cp is not None and cluster.cp.url
    up = urlsplit(cluster.cp.url)
    assert up.hostname and up.port
    work = Path(tempfile.mkdtemp(prefix="dynsnap-quiesce-"))
    async with HeldLink(cluster.net.gateway, (up.hostname, up.port)) as link:
        fe_cfg = cluster.cp.kubeconfig_for("dynamo", work / "frontend.kubeconfig", server=link.url)
        async with running(cluster, graph("quiesce-routing", fe_cfg),
                           controller_args=["--quiesce-timeout", str(QUIESCE_TIMEOUT)]) as env:
            pod, peer = env.graph.workers("worker")
            wid = instance_id_from_dwm(await env.api.get(R.DWMS, pod.name, namespace=pod.namespace))
            for p in (pod, peer):
                await env.fe.wait_routable(instance_id_from_dwm(await env.api.get(R.DWMS, p.name,
                                                                                  namespace=p.namespace)))
            link.hold()  # the frontend's view of endpoints stops here
            try:
                async with history(env.api, R.WORKER_SNAPSHOTS, pod) as wss:
                    await suspend_by_hand(env, pod)
                    await called_off(wss)
                    # The endpoint is not ready, and the controller sees it (its "endpoint-not-ready" step
                    # passed, asserted below); the frontend does not, and a request pinned to the worker
                    # is still answered by it. The called-off quiesce put the worker back into serving
                    # and the next one takes it out again (the override still asks for a capture), so
                    # the endpoint's own state is awaited, bounded, not read once (CI at 3a3de3f read
                    # it ready in between).
                    async def not_ready() -> bool:
                        return await endpoint_ready(env, pod) is False
                    assert await wait_for("the endpoint not ready", not_ready, timeout=30, interval=0.2)
                    answer = await env.fe.chat("routed?", worker_id=wid, max_tokens=1)
                    assert answer.status == 200 and answer.worker_id == wid, answer.body
                    await assert_called_off(env, pod, wss, ["gate", "endpoint-not-ready"])
            finally:
                link.release()
            await captured_after_all_steps(env, pod)


@contextlib.contextmanager
def stopped(pod: RunningPod) -> Iterator[list[int]]:
    """Every process of the pod stopped (SIGSTOP) for the block: it answers nothing, its connections
    stay open (requests to it time out), then it carries on (SIGCONT)."""
    ns = procfs.pid_ns(pod.sandbox.pid)
    assert ns is not None, f"{pod.name}: not running"
    pids = [p.pid for p in procfs.in_pid_ns(ns)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def counted(events: list[Obj], reason: str) -> int:
    """How many times the Events of ``reason`` say it happened (each Event's series count, or 1)."""
    return sum(int((e.get("series") or {}).get("count") or 1) for e in events if e["reason"] == reason)


async def wake_by_hand(env: CtlEnv, pod: RunningPod) -> None:
    """What ``dynsnap wake POD`` writes (here as the test's admin)."""
    await env.api.merge_patch(R.PODS, pod.name, {"metadata": {"annotations": {P.ANN_DESIRED_STATE: "active"}}},
                              namespace=pod.namespace)


async def test_no_capture_while_the_frontend_cannot_say_it_stopped_routing(cluster: LocalCluster) -> None:
    async with running(cluster, graph("quiesce-fe-down"),
                       controller_args=["--quiesce-timeout", str(QUIESCE_TIMEOUT), "--verify-request-timeout", "2"]
                       ) as env:
        pod, peer = env.graph.workers("worker")
        wid = instance_id_from_dwm(await env.api.get(R.DWMS, pod.name, namespace=pod.namespace))
        for p in (pod, peer):
            await env.fe.wait_routable(instance_id_from_dwm(await env.api.get(R.DWMS, p.name, namespace=p.namespace)))
        async with history(env.api, R.WORKER_SNAPSHOTS, pod) as wss:
            # One whole cycle first (captured, woken, verified): the controller has the graph's model
            # from the frontend, so below it does ask the frontend about the worker itself.
            await suspend_by_hand(env, pod)
            await captured_after_all_steps(env, pod)
            since = (((await get_ws(env.api, pod)) or {}).get("status") or {}).get("lastWake", {}).get("id")
            await wake_by_hand(env, pod)

            async def woken() -> bool:
                return verified_after(since)(await get_ws(env.api, pod))
            await wait_for(f"{pod.name} woken and verified", woken, timeout=120, interval=0.3)
            async with history(env.api, R.WORKER_SNAPSHOTS, pod) as since_stopped:
                with stopped(env.graph.frontend):
                    await suspend_by_hand(env, pod)
                    # The endpoint goes not ready (the controller sees it), but the frontend answers
                    # nothing: a timeout is no refusal, so no capture, and the quiesce ends at its deadline.
                    await assert_called_off(env, pod, since_stopped, ["gate", "endpoint-not-ready"])
            # The frontend back: the recall is verified, the override asks again, and this time the
            # frontend refuses the instance; only then is the capture asked for.
            await captured_after_all_steps(env, pod)
            # What that refusal is (the controller counts exactly this answer, dynsnap/controller/routing.py).
            refusal = await env.fe.chat("routed?", worker_id=wid, max_tokens=1)
            assert refusal.status == 400 and refusal.body == {"message": "Invalid request", "type": "Bad Request",
                                                              "code": 400}, json.dumps(refusal.body)
        quiesces = {quiesce_of(v).get("id") for v in wss if quiesce_of(v).get("id")}
        assert len(quiesces) == 3, quiesces  # captured, called off, captured
        assert counted(await events_for(env.api, pod.namespace, pod.name), "Quiescing") == len(quiesces)
