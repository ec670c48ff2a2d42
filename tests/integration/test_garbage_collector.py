"""The real kube-controller-manager's garbage collector deletes a DWM whose owner pod is gone, and
only by ownership (an unowned DWM beside it stays). No node runs anything: the pod is an object of a
kwok node. (The EndpointSlice controller following a gated pod's readiness is test_real_node.py's.)
"""

from __future__ import annotations

import uuid

import pytest

from dynsnap.models import resources as R
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster, wait_for

pytestmark = pytest.mark.cluster


async def test_garbage_collector_deletes_dwm_of_deleted_pod(cluster: LocalCluster) -> None:
    api = cluster.api
    name = f"gc-{uuid.uuid4().hex[:6]}"
    pod = await api.create(R.PODS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": TEST_NAMESPACE},
        "spec": {"nodeName": "node-b", "containers": [{"name": "main", "image": "stub"}]},
    })
    dwm = await api.create(R.DWMS, {
        "apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoWorkerMetadata",
        "metadata": {"name": name, "namespace": TEST_NAMESPACE, "ownerReferences": [{
            "apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod["metadata"]["uid"]}]},
        "spec": {"data": {"endpoints": {"generate": {"instance_id": 1}}}},
    })
    assert dwm["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    # An unowned DWM next to it must survive: the collector deletes by ownership, not by sweep.
    bystander = f"{name}-unowned"
    await api.create(R.DWMS, {"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoWorkerMetadata",
                              "metadata": {"name": bystander, "namespace": TEST_NAMESPACE}, "spec": {"data": {}}})
    await api.delete(R.PODS, name, namespace=TEST_NAMESPACE, grace_period_seconds=0)

    async def dwm_gone() -> bool:
        names = {d["metadata"]["name"] for d in (await api.list(R.DWMS, namespace=TEST_NAMESPACE))["items"]}
        return name not in names
    await wait_for("DWM garbage-collected", dwm_gone, timeout=90)
    assert (await api.get(R.DWMS, bystander, namespace=TEST_NAMESPACE))["metadata"]["name"] == bystander
    await api.delete(R.DWMS, bystander, namespace=TEST_NAMESPACE)
