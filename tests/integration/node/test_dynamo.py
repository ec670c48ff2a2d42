"""Dynamo 1.6.1's own facts that dynsnap builds on, on the real node (moved from the sandboxes'
test_dynamo.py): examples/dgd/agg.yaml and disagg.yaml under the local overlay, **not opted in**
(``dynsnap.io/enabled: "false"``: the chart's controller only lets their gated pods serve), their
frontend and mocker workers pods of kubelet, containerd and runc with Kubernetes discovery:

- the frontend serves chat completions through Kubernetes discovery, answered by one of the workers;
- each worker has its DynamoWorkerMetadata, owned by its pod;
- a request pinned to a worker (``x-dynamo-worker-instance-id``) is answered by that worker, and an id
  no worker has is refused, never rerouted;
- a disaggregated prefill/decode pair serves a request pinned with both headers, each role by its id;
- the ``dynsnap.io/serving`` readiness gate, set False as dynsnap sets it (the controller scaled to 0,
  so nobody puts it back), takes kubelet's Ready and the EndpointSlice endpoint away and the frontend
  stops routing to the worker: a request pinned to it is refused, never served by another, unpinned ones
  all go to its peer; set True, the same worker (the same DWM, the same instance id) is routed to again;
- a request not yet at its first token counts in both of the frontend's gauges,
  ``dynamo_frontend_inflight_requests`` and ``dynamo_frontend_queued_requests`` (the queue is a part of
  in-flight, not beside it): the controller's demand for one such request is 1, not 2.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from realnodeenv import Env, deployed, instance_id, scale_controller
from realnodefacts import container_procs, stopped

from dynsnap.controller.frontend import Frontend
from dynsnap.controller.plan import Demand
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import kubelet_facts

pytestmark = pytest.mark.cluster

NOT_OPTED_IN = {P.ANN_ENABLED: "false"}
DISAGG = chart_node.ROOT / "examples" / "dgd" / "disagg.yaml"


@pytest.fixture(scope="module")
async def agg(env: Env) -> AsyncIterator[real_graph.Graph]:
    async with deployed(env, chart_node.example_body(env, name="dyn-agg", worker_replicas=2,
                                                     policy=NOT_OPTED_IN)) as graph:
        yield graph


@pytest.fixture
async def fe(agg: real_graph.Graph) -> AsyncIterator[D.FrontendClient]:
    client = D.FrontendClient(agg.frontend, timeout=60.0)
    try:
        await client.wait_model(timeout=120)
        yield client
    finally:
        await client.close()


def _workers(graph: real_graph.Graph) -> list[real_graph.NodePod]:
    return graph.workers(chart_node.WORKER_COMPONENT)


async def test_frontend_serves_chat_through_kubernetes_discovery(env: Env, agg: real_graph.Graph,
                                                                  fe: D.FrontendClient) -> None:
    res = await fe.chat("Hello!")
    assert res.status == 200 and res.text, res.body
    assert res.worker_id in {await instance_id(env, w) for w in _workers(agg)}


async def test_each_worker_has_a_dwm_owned_by_its_pod(env: Env, agg: real_graph.Graph) -> None:
    for w in _workers(agg):
        dwm = await env.api.get(R.DWMS, w.name, namespace=w.namespace)
        owners = dwm["metadata"].get("ownerReferences", [])
        assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [("Pod", w.name, w.uid)]


async def test_pinned_request_is_answered_by_that_worker(env: Env, agg: real_graph.Graph,
                                                         fe: D.FrontendClient) -> None:
    ids = [await instance_id(env, w) for w in _workers(agg)]
    assert len(set(ids)) == 2
    for wid in ids:
        await fe.wait_routable(wid, timeout=60)
    for wid in ids:
        for _ in range(3):
            res = await fe.chat("Who answers?", worker_id=wid)
            assert res.status == 200 and res.worker_id == wid, res.body
    bogus = await fe.chat("nobody", worker_id=max(ids) + 1)  # an id no worker has: refused, never rerouted
    assert bogus.status >= 400 and bogus.worker_id is None, bogus.body


async def _endpoint_ready(env: Env, pod: real_graph.NodePod) -> bool | None:
    ep = await env.cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")  # type: ignore[arg-type]  # its UID
    return None if ep is None else bool(ep["conditions"].get("ready"))


async def test_readiness_gate_takes_a_worker_out_of_dynamo_routing_and_back(env: Env, agg: real_graph.Graph,
                                                                            fe: D.FrontendClient) -> None:
    a, b = _workers(agg)
    id_a, id_b = await instance_id(env, a), await instance_id(env, b)
    dwm_uid = (await env.api.get(R.DWMS, a.name, namespace=a.namespace))["metadata"]["uid"]
    for wid in (id_a, id_b):
        await fe.wait_routable(wid, timeout=60)
    await scale_controller(env, 0)  # nobody but the test sets the gate now
    try:
        await env.cluster.set_serving_gate(a, False)
        await env.cluster.wait_ready(a.namespace, a.name, ready=False, timeout=60)
        await wait_for("a's endpoint not ready", lambda: _not_ready(env, a), timeout=60)

        async def a_refused() -> bool:
            return (await fe.chat("a?", worker_id=id_a)).status != 200
        await wait_for("the frontend drops worker a", a_refused, timeout=60)
        res = await fe.chat("a, still?", worker_id=id_a)
        assert res.status >= 400 and res.worker_id is None, res.body  # refused, not served by b
        for _ in range(4):
            res = await fe.chat("anyone")
            assert res.status == 200 and res.worker_id == id_b, res.body

        await env.cluster.set_serving_gate(a, True)
        await env.cluster.wait_ready(a.namespace, a.name, timeout=60)
        await wait_for("a's endpoint ready", lambda: _endpoint_ready(env, a), timeout=60)

        async def a_serves() -> bool:
            r = await fe.chat("a again", worker_id=id_a)
            return r.status == 200 and r.worker_id == id_a
        await wait_for("the frontend routes to worker a again", a_serves, timeout=60)
        dwm = await env.api.get(R.DWMS, a.name, namespace=a.namespace)  # no re-registration was needed
        assert dwm["metadata"]["uid"] == dwm_uid and instance_id_from_dwm(dwm) == id_a
    finally:
        await scale_controller(env, 1)


async def _not_ready(env: Env, pod: real_graph.NodePod) -> bool:
    return await _endpoint_ready(env, pod) is False


async def test_disaggregated_pair_serves_a_request_pinned_with_both_headers(env: Env, agg: real_graph.Graph) -> None:
    """One prefill and one decode worker (beside the module's agg graph, within the package's GPUs)."""
    body = chart_node.example_body(env, example=DISAGG, name="dyn-disagg", worker_replicas=1, policy=NOT_OPTED_IN)
    async with deployed(env, body) as graph:
        fe = D.FrontendClient(graph.frontend, timeout=60.0)
        try:
            (prefill,), (decode,) = graph.workers("prefill"), graph.workers("decode")
            prefill_id, decode_id = await instance_id(env, prefill), await instance_id(env, decode)
            await fe.wait_routable(decode_id, prefill_id=prefill_id, timeout=60)
            res = await fe.chat("Split me", worker_id=decode_id, prefill_id=prefill_id)
            assert res.status == 200, res.body
            assert (res.worker_id, res.prefill_worker_id) == (decode_id, prefill_id)
        finally:
            await fe.close()


async def test_a_request_before_its_first_token_is_in_flight_and_queued_at_once(env: Env, agg: real_graph.Graph,
                                                                               fe: D.FrontendClient) -> None:
    """The worker's processes stopped (SIGSTOP, its entrypoint running), a request pinned to it gets no
    first token: the frontend's page counts it once in flight and once queued, and the controller's own
    scrape makes that a demand of 1. Continued, the worker answers it and both gauges are 0 again. (The
    frontend raises its in-flight gauge a moment before its queue gauge: a look at that moment saw 1 in
    flight and 0 queued, in 2 of 9 runs; held, it stays 1 and 1. Never more queued than in flight.)"""
    w = _workers(agg)[0]
    wid = await instance_id(env, w)
    await fe.wait_routable(wid, timeout=60)
    procs = container_procs(w.uid, (await kubelet_facts(env.api, w)).container_id)
    front = Frontend(timeout=5)
    base = f"http://{agg.frontend.ip}:{P.DYNAMO_FRONTEND_PORT}"
    held: asyncio.Task[D.ChatResult] | None = None
    try:
        with stopped(list(procs.tree)):
            held = asyncio.create_task(fe.chat("held before its first token", worker_id=wid, max_tokens=2))

            looks: list[Demand] = []

            async def queued() -> Demand | None:
                looks.append(d := await front.demand(base))
                return d if d.queued > 0 else None
            d = await wait_for("the held request queued on the frontend's page", queued, timeout=30, interval=0.2)
            assert (d.inflight, d.queued, d.total) == (1.0, 1.0, 1.0), d
            assert all(x.queued <= x.inflight for x in looks), looks
            assert not held.done()
        res = await asyncio.wait_for(held, 60)
        assert res.status == 200 and res.worker_id == wid, res.body

        async def drained() -> Demand | None:
            d = await front.demand(base)
            return d if d.total == 0 else None
        after = await wait_for("both gauges back to 0", drained, timeout=30, interval=0.2)
        assert (after.inflight, after.queued) == (0.0, 0.0)
    finally:
        if held is not None and not held.done():  # a check failed before it was answered
            held.cancel()
        await front.close()
