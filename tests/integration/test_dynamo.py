"""Dynamo 1.6.1 for real on the local cluster: a frontend and mocker workers in pod
sandboxes with Kubernetes discovery serve chat completions; each worker's DWM exists and
is owned by its pod; a request pinned to a worker is answered by that worker; a
disaggregated prefill+decode pair serves a request pinned with both headers; dynsnap's
readiness gate takes a worker out of the EndpointSlice and out of Dynamo's routing, and
back, with the same DWM."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

import pytest

from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
async def agg(cluster: LocalCluster) -> AsyncIterator[D.Graph]:
    graph = await D.deploy(cluster, D.dgd("agg", [D.frontend_component(), D.mocker_component("worker", replicas=2)]))
    try:
        yield graph
    finally:
        await D.teardown(cluster, graph)


async def test_frontend_serves_chat_through_kubernetes_discovery(cluster: LocalCluster, agg: D.Graph) -> None:
    fe = D.FrontendClient(agg.frontend)
    try:
        await fe.wait_model()
        res = await fe.chat("Hello!")
        assert res.status == 200, res.body
        assert res.text
        ids = {await D.instance_id(cluster, w) for w in agg.workers("worker")}
        assert res.worker_id in ids
    finally:
        await fe.close()


async def test_each_worker_has_a_dwm_owned_by_its_pod(cluster: LocalCluster, agg: D.Graph) -> None:
    for w in agg.workers("worker"):
        dwm = await cluster.api.get(R.DWMS, w.name, namespace=w.namespace)
        owners = dwm["metadata"].get("ownerReferences", [])
        assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [("Pod", w.name, w.uid)]


async def test_pinned_request_is_answered_by_that_worker(cluster: LocalCluster, agg: D.Graph) -> None:
    fe = D.FrontendClient(agg.frontend)
    try:
        await fe.wait_model()
        ids = [await D.instance_id(cluster, w) for w in agg.workers("worker")]
        assert len(set(ids)) == 2
        for wid in ids:
            await fe.wait_routable(wid)
        for wid in ids:
            for _ in range(3):
                res = await fe.chat("Who answers?", worker_id=wid)
                assert res.status == 200, res.body
                assert res.worker_id == wid
        # An id no worker has is refused, never rerouted.
        bogus = await fe.chat("nobody", worker_id=max(ids) + 1)
        assert bogus.status >= 400 and bogus.worker_id is None
    finally:
        await fe.close()


async def test_disaggregated_pair_serves_request_pinned_with_both_headers(cluster: LocalCluster) -> None:
    graph = await D.deploy(cluster, D.dgd("disagg", [
        D.frontend_component(router_mode="kv"),
        D.mocker_component("prefill", replicas=1, mode="prefill", sub="prefill"),
        D.mocker_component("decode", replicas=1, mode="decode", sub="decode"),
    ]))
    fe = D.FrontendClient(graph.frontend)
    try:
        await fe.wait_model()
        prefill_id = await D.instance_id(cluster, graph.workers("prefill")[0])
        decode_id = await D.instance_id(cluster, graph.workers("decode")[0])
        await fe.wait_routable(decode_id, prefill_id=prefill_id)
        res = await fe.chat("Split me", worker_id=decode_id, prefill_id=prefill_id)
        assert res.status == 200, res.body
        assert res.worker_id == decode_id
        assert res.prefill_worker_id == prefill_id
    finally:
        await fe.close()
        await D.teardown(cluster, graph)


async def _slice_ready(cluster: LocalCluster, pod: D.RunningPod) -> bool | None:
    ep = await cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")
    return None if ep is None else bool(ep["conditions"].get("ready"))


async def test_readiness_gate_takes_a_worker_out_of_dynamo_routing_and_back(cluster: LocalCluster) -> None:
    gated = {"readinessGates": [{"conditionType": P.CONDITION_SERVING}]}
    graph = await D.deploy(cluster, D.dgd("gate", [D.frontend_component(),
                                                   D.mocker_component("worker", replicas=2, extra_pod_spec=gated)]),
                           wait=False)
    a, b = graph.workers("worker")
    fe = D.FrontendClient(graph.frontend)
    try:
        # A gate nobody has set counts as False: neither worker is Ready until dynsnap sets it.
        for w in (a, b):
            await cluster.wait_ready(w.namespace, w.name, ready=False, timeout=60)
            await cluster.set_serving_gate(w, True)
        for w in (a, b):
            await cluster.wait_ready(w.namespace, w.name, timeout=60)
        await fe.wait_model()
        id_a, id_b = await D.instance_id(cluster, a), await D.instance_id(cluster, b)
        await fe.wait_routable(id_a)
        await fe.wait_routable(id_b)

        await cluster.set_serving_gate(a, False)
        await cluster.wait_ready(a.namespace, a.name, ready=False, timeout=30)
        await wait_for("a's endpoint not ready", lambda: _not(_slice_ready(cluster, a)), timeout=30)

        # The frontend stops routing to it: a request pinned to it is refused, never served
        # by another worker; unpinned traffic all goes to b.
        async def a_refused() -> bool:
            return (await fe.chat("a?", worker_id=id_a)).status != 200
        await wait_for("frontend drops worker a", a_refused, timeout=30)
        for _ in range(4):
            res = await fe.chat("anyone")
            assert res.status == 200 and res.worker_id == id_b

        await cluster.set_serving_gate(a, True)
        await cluster.wait_ready(a.namespace, a.name, timeout=30)
        await wait_for("a's endpoint ready", lambda: _slice_ready(cluster, a), timeout=30)

        async def a_serves() -> bool:
            res = await fe.chat("a again", worker_id=id_a)
            return res.status == 200 and res.worker_id == id_a
        await wait_for("frontend routes to worker a again", a_serves, timeout=30)
        # Same DWM object throughout: no re-registration was needed.
        assert D.instance_id_from_dwm(await cluster.api.get(R.DWMS, a.name, namespace=a.namespace)) == id_a
    finally:
        await fe.close()
        await D.teardown(cluster, graph)


async def _not(aw: Awaitable[bool | None]) -> bool:
    return (await aw) is False
