"""Dynamo 1.6.1 for real on the local cluster: a frontend and mocker workers in pod
sandboxes with Kubernetes discovery serve chat completions; each worker's DWM exists and
is owned by its pod; a request pinned to a worker is answered by that worker; a
disaggregated prefill+decode pair serves a request pinned with both headers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster

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
        res = await fe.chat("Split me", worker_id=decode_id, prefill_id=prefill_id)
        assert res.status == 200, res.body
        assert res.worker_id == decode_id
        assert res.prefill_worker_id == prefill_id
    finally:
        await fe.close()
        await D.teardown(cluster, graph)
