"""The real kube-controller-manager: the EndpointSlice controller follows a sandboxed
pod's readiness (including a readiness gate), and the garbage collector deletes a DWM
whose owner pod is gone.

Sandbox, why: it checks the real kube-controller-manager against a pod whose readiness the test sets
itself; no dynsnap part runs.
"""

from __future__ import annotations

import sys
import uuid

import pytest

from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster, wait_for

pytestmark = pytest.mark.cluster


async def test_endpointslice_follows_readiness_gate(cluster: LocalCluster) -> None:
    api = cluster.api
    name = f"web-{uuid.uuid4().hex[:6]}"
    labels = {"app": name}
    await api.create(R.SERVICES, {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": TEST_NAMESPACE},
        "spec": {"clusterIP": "None", "selector": labels, "ports": [{"name": "http", "port": 8080}]},
    })
    pod = await cluster.run_pod({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": TEST_NAMESPACE, "labels": labels},
        "spec": {
            "readinessGates": [{"conditionType": P.CONDITION_SERVING}],
            "containers": [{
                "name": "main", "image": "python:stub",
                "command": [sys.executable, "-m", "http.server", "8080", "--bind", "0.0.0.0"],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
            }],
        },
    })
    selector = f"kubernetes.io/service-name={name}"

    async def container_ready_gate_unset() -> bool:
        pod_obj = await api.get(R.PODS, name, namespace=TEST_NAMESPACE)
        conds = {c["type"]: c["status"] for c in pod_obj["status"].get("conditions") or []}
        return conds.get("ContainersReady") == "True" and conds.get("Ready") == "False"

    async def endpoint_ready(want: bool) -> bool:
        ep = await cluster.endpoint_of(pod, label_selector=selector)
        return ep is not None and ep["conditions"].get("ready") is want and ep["addresses"] == [pod.ip]

    # As with kubelet, a gate nobody has set yet counts as False: the probe passes, the pod is not Ready.
    await wait_for("containers ready, pod not Ready", container_ready_gate_unset, timeout=60)
    await wait_for("endpoint published not ready", lambda: endpoint_ready(False), timeout=60)

    await cluster.set_serving_gate(pod, True)
    await cluster.wait_ready(TEST_NAMESPACE, name, ready=True, timeout=30)
    await wait_for("endpoint ready", lambda: endpoint_ready(True), timeout=60)

    await cluster.set_serving_gate(pod, False)
    await cluster.wait_ready(TEST_NAMESPACE, name, ready=False, timeout=30)
    await wait_for("endpoint not ready", lambda: endpoint_ready(False), timeout=30)

    await cluster.set_serving_gate(pod, True)
    await cluster.wait_ready(TEST_NAMESPACE, name, ready=True, timeout=30)
    await wait_for("endpoint ready again", lambda: endpoint_ready(True), timeout=30)

    await cluster.delete_pod(TEST_NAMESPACE, name)
    await api.delete(R.SERVICES, name, namespace=TEST_NAMESPACE)


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
