"""The quiesce before a capture waits for each of its conditions itself; none stands in for another.
On the real node (kubelet, containerd, runc; dynsnap installed by ``helm install``: realnodeenv.py),
examples/dgd/agg.yaml under the local overlay with Dynamo's mocker. A worker taken out of serving
(its ``dynsnap.io/serving`` gate False) is captured only once the controller's own view shows its
EndpointSlice endpoint not ready *and* the frontend refuses a request pinned to it (it no longer
routes there) *and* nothing is in flight. Two of them are made to lag:

- the controller's view of EndpointSlices (its watch silenced by fake_apiproxy, which the chart's
  controller pod reaches on the bridge's gateway as its API server): the endpoint is not ready and
  the frontend has stopped routing to the worker, but the controller cannot see the first, so the
  quiesce is called off at ``controller.quiesceTimeout`` (``WorkerServing``), never captured;
- the frontend's view (its pod's link to the API server held by fake_held_link): the endpoint is not
  ready, but the frontend still routes to the worker, and a pinned request is answered by it, so the
  quiesce is called off too.

And the frontend's answer must be its explicit refusal of that instance (issue 18: fail closed):

- the frontend unavailable mid-quiesce (its container's processes stopped, so the pinned request
  times out): no answer is no refusal, nothing is captured, and the quiesce is called off at its
  deadline.

Once the view catches up, the next quiesce passes all its steps and the worker is captured. The
capture is asked for by hand (the WorkerSnapshot's ``dynsnap.io/override: Suspended``) with a serving peer, so
min-active allows it and nothing else decides. Each quiesce is counted: the worker's Quiescing
Event's ``series.count`` (or its Events) is the number of quiesces it went through.

The module upgrades the shared install for its tests (``helm upgrade``: the controller's API server
is the proxy, its quiesce and verification bounds short) and back after.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
from controllerenv import asleep, events_for, get_ws, history, policy, set_override, verified_after
from fake_held_link import HeldLink
from realnodeenv import (
    WORKER_COMPONENT,
    Env,
    api_server_env,
    component_policy,
    controller_through_proxy,
    deployed,
    instance_id,
)
from realnodefacts import container_pid, stopped

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault
from dynsnap.testenv.real_graph import Graph, NodePod

pytestmark = pytest.mark.cluster

QUIESCE_TIMEOUT = 8
ALL_STEPS = ["gate", "endpoint-not-ready", "frontend-stopped-routing", "drained"]


@pytest.fixture(scope="module")
async def proxy(env: Env) -> AsyncIterator[FakeApiProxy]:
    """The chart's controller through fake_apiproxy (realnodeenv.controller_through_proxy), with this
    module's quiesce and verification bounds."""
    async with controller_through_proxy(env, quiesceTimeout=QUIESCE_TIMEOUT, verifyRequestTimeout=2) as p:
        yield p


def graph(env: Env, name: str, frontend_env: list[Obj] | None = None) -> Obj:
    """Two mocker workers, one kept serving; idleness puts nobody to sleep within the test (only the
    manual suspend does). ``frontend_env``: more environment for the frontend's container."""
    body = chart_node.example_body(env, name=name, worker_replicas=2, speedup_ratio=1, policy=policy(
        enabled=True, idle_after="1h", tier="suspend"))
    if frontend_env:
        fe = next(c for c in body["spec"]["components"] if c["type"] == "frontend")
        main = next(c for c in fe["podTemplate"]["spec"]["containers"] if c["name"] == "main")
        main.setdefault("env", []).extend(frontend_env)
    return component_policy(body, WORKER_COMPONENT, policy(min_active=1, verify_requests=1))


async def suspend_by_hand(env: Env, pod: NodePod) -> None:
    """What ``dynsnap suspend POD`` writes (here as the test's admin)."""
    await set_override(env.api, pod, "suspended")


async def wake_by_hand(env: Env, pod: NodePod) -> None:
    """What ``dynsnap wake POD`` writes (here as the test's admin)."""
    await set_override(env.api, pod, "active")


def quiesce_of(ws: Obj | None) -> Obj:
    return (((ws or {}).get("status") or {}).get("controller") or {}).get("quiesce") or {}


async def called_off(wss: list[Obj]) -> Obj:
    """The first WorkerSnapshot version whose quiesce ended without a capture."""
    async def found() -> Obj | None:
        return next((ws for ws in wss if quiesce_of(ws).get("ok") is False), None)
    ws: Obj = await wait_for("the quiesce called off", found, timeout=QUIESCE_TIMEOUT + 60, interval=0.2)
    return ws


async def endpoint_ready(env: Env, pod: NodePod) -> bool | None:
    ep = await env.cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")  # type: ignore[arg-type]
    return None if ep is None else bool(ep["conditions"].get("ready"))


async def endpoint_not_ready(env: Env, pod: NodePod) -> None:
    """The EndpointSlice controller follows the gate in its own time (once in CI not yet within the
    quiesce timeout): awaited, bounded."""
    async def not_ready() -> bool:
        return await endpoint_ready(env, pod) is False
    await wait_for("the endpoint not ready", not_ready, timeout=30, interval=0.2)


async def assert_called_off(env: Env, pod: NodePod, wss: list[Obj], steps: list[str]) -> None:
    ws = await called_off(wss)
    q = quiesce_of(ws)
    assert [s["name"] for s in q["steps"]] == steps, q
    assert not [v for v in wss if v["spec"]["desiredState"] == "Suspended"], "a capture was asked for"
    # The controller writes the quiesce's end first and its Event after: the Event is waited for (bounded).
    note = f"quiesce did not finish in {QUIESCE_TIMEOUT}s; capture called off"

    async def warned() -> bool:
        return any(e["type"] == "Warning" and e["reason"] == "WorkerServing" and note in (e.get("note") or "")
                   for e in await events_for(env.api, pod.namespace, pod.name))
    try:
        await wait_for("the Warning WorkerServing", warned, timeout=30, interval=0.3)
    except TimeoutError:
        said = [(e["type"], e["reason"], e.get("note")) for e in await events_for(env.api, pod.namespace, pod.name)]
        print("EVENTS:", said, "CONTROLLER:", ws["status"].get("controller"))
        raise


async def captured_after_all_steps(env: Env, pod: NodePod) -> None:
    """Once the view caught up: the next quiesce passes every step and the worker is captured."""
    async def slept() -> Obj | None:
        ws = await get_ws(env.api, pod)
        return ws if asleep(ws) else None
    ws: Obj = await wait_for(f"{pod.name} captured", slept, timeout=180, interval=0.5)
    q = quiesce_of(ws)
    assert q.get("ok") is True and [s["name"] for s in q["steps"]] == ALL_STEPS, q


async def _first_of_both_routable(env: Env, g: Graph) -> tuple[NodePod, int]:
    """The graph's first worker and its instance id, once the frontend routes to both workers."""
    assert env.fe is not None
    pods = g.workers(WORKER_COMPONENT)
    for p in pods:
        await env.fe.wait_routable(await instance_id(env, p))
    return pods[0], await instance_id(env, pods[0])


async def test_no_capture_while_the_controller_still_sees_the_endpoint_ready(env: Env, proxy: FakeApiProxy) -> None:
    async with deployed(env, graph(env, "quiesce-slices")) as g:
        pod, wid = await _first_of_both_routable(env, g)
        # The controller's view of EndpointSlices first catches up with both endpoints ready (as the API
        # server has them), then stops there: its connections are cut, its next watch is answered 410
        # (so it lists afresh) and the one after goes silent.
        for p in g.workers(WORKER_COMPONENT):
            await wait_for(f"{p.name}'s endpoint ready", lambda p=p: endpoint_ready(env, p), timeout=60)
        proxy.add(Fault("respond", path_contains="/endpointslices", watch=True, status=410))
        proxy.add(Fault("silent_after", path_contains="/endpointslices", watch=True, times=None))
        proxy.abort_all()

        async def silenced() -> bool:
            return any(s.fault == "silent_after" for s in proxy.seen(path_contains="/endpointslices", watch=True))
        await wait_for("the controller's EndpointSlice watch relisted, then silenced", silenced, timeout=60)

        try:
            async with history(env.api, R.WORKER_SNAPSHOTS, pod) as wss:
                await suspend_by_hand(env, pod)
                await called_off(wss)
                # The world moved on: the endpoint is not ready and the frontend refuses it. Only the
                # controller's view lags, and a capture waits for that view.
                await endpoint_not_ready(env, pod)

                # The frontend follows the EndpointSlice in its own time too (its watch, then its
                # router's instance list): awaited, bounded, and asserted.
                async def refused() -> bool:
                    assert env.fe is not None
                    return (await env.fe.chat("routed?", worker_id=wid, max_tokens=1)).status == 400
                await wait_for("the frontend refusing the worker", refused, timeout=30, interval=0.2)
                await assert_called_off(env, pod, wss, ["gate"])
        finally:
            proxy.clear()
            proxy.abort_all()  # the controller watches again, unsilenced, from where it was
        await captured_after_all_steps(env, pod)


async def test_no_capture_while_the_frontend_still_routes_to_the_worker(env: Env, proxy: FakeApiProxy) -> None:
    cp = env.cluster.cp
    assert cp is not None and cp.url
    up = urlsplit(cp.url)
    assert up.hostname and up.port
    async with HeldLink(env.cluster.net.gateway, (up.hostname, up.port)) as link, deployed(
            env, graph(env, "quiesce-routing", api_server_env(link.host, link.port))) as g:
        pod, wid = await _first_of_both_routable(env, g)
        assert env.fe is not None
        link.hold()  # the frontend's view of endpoints stops here
        try:
            async with history(env.api, R.WORKER_SNAPSHOTS, pod) as wss:
                await suspend_by_hand(env, pod)
                await called_off(wss)
                # The endpoint is not ready, and the controller sees it (its "endpoint-not-ready" step
                # passed, asserted below); the frontend does not, and a request pinned to the worker is
                # still answered by it. The called-off quiesce put the worker back into serving and the
                # next one takes it out again (the override still asks for a capture), so the
                # endpoint's own state is awaited, bounded, not read once.
                await endpoint_not_ready(env, pod)
                answer = await env.fe.chat("routed?", worker_id=wid, max_tokens=1)
                assert answer.status == 200 and answer.worker_id == wid, answer.body
                await assert_called_off(env, pod, wss, ["gate", "endpoint-not-ready"])
        finally:
            link.release()
        await captured_after_all_steps(env, pod)


def container_stopped(pod: Obj, container: str) -> contextlib.AbstractContextManager[list[int]]:
    """Every process of the pod's ``container`` stopped for the block (realnodefacts.stopped)."""
    ns = procfs.pid_ns(container_pid(pod, container))
    assert ns is not None, f"{pod['metadata']['name']}: not running"
    return stopped([int(p.pid) for p in procfs.in_pid_ns(ns)])


def counted(events: list[Obj], reason: str) -> int:
    """How many times the Events of ``reason`` say it happened (each Event's series count, or 1)."""
    return sum(int((e.get("series") or {}).get("count") or 1) for e in events if e["reason"] == reason)


async def test_no_capture_while_the_frontend_cannot_say_it_stopped_routing(env: Env, proxy: FakeApiProxy) -> None:
    async with deployed(env, graph(env, "quiesce-fe-down")) as g:
        pod, wid = await _first_of_both_routable(env, g)
        assert env.fe is not None
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
            frontend = await env.api.get(R.PODS, g.frontend.name, namespace=g.frontend.namespace)
            async with history(env.api, R.WORKER_SNAPSHOTS, pod) as since_stopped:
                with container_stopped(frontend, "main"):
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
