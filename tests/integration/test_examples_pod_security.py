"""The examples' pods are admitted at Pod Security's baseline level (issue 39): a namespace labelled
``pod-security.kubernetes.io/enforce: baseline`` admits every pod Dynamo's operator would make of
examples/dgd/agg.yaml and disagg.yaml (the stand-in operator's pods of the graph as shipped, created
with ``dryRun=All``), and the real API server's PodSecurity admission refuses the same worker with the
capability the examples used to add (CHECKPOINT_RESTORE), naming it: the check can fail. That the
workers run and wake in both tiers without it is shown on the real node (test_real_node_wake.py: no
capability, the pid range reserved, both tiers' cycles).
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path

import pytest
import yaml

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import ApiError
from dynsnap.models import resources as R
from dynsnap.testenv import stub_operator
from dynsnap.testenv.cluster import LocalCluster

pytestmark = pytest.mark.cluster

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "dgd").glob("*.yaml"))


async def _pods(cluster: LocalCluster, path: Path, namespace: str) -> list[Obj]:
    """The pods the operator would make of the example in ``namespace``, with the service account they
    name there (the operator's, which admission looks up)."""
    dgd = yaml.safe_load(path.read_text())
    dgd["metadata"]["namespace"] = namespace
    dgd["metadata"]["uid"] = str(uuid.uuid4())  # the owner reference the operator's pods carry
    await cluster.api.create(R.SERVICE_ACCOUNTS, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
        "name": stub_operator.discovery_sa(dgd), "namespace": namespace}})
    pods = [p for comp in stub_operator.components(dgd) for p in stub_operator.component_pods(dgd, comp)]
    assert pods
    return pods


async def _dry_create(cluster: LocalCluster, pod: Obj) -> None:
    ns = pod["metadata"]["namespace"]
    await cluster.api.request("POST", R.PODS.path(namespace=ns), body=pod, query={"dryRun": "All"})


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
async def test_a_baseline_namespace_admits_the_examples_pods_and_refuses_an_added_capability(
        cluster: LocalCluster, path: Path) -> None:
    ns = f"pss-baseline-{uuid.uuid4().hex[:6]}"
    await cluster.api.create(R.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": ns, "labels": {"pod-security.kubernetes.io/enforce": "baseline",
                               "pod-security.kubernetes.io/enforce-version": "latest"}}})
    try:
        pods = await _pods(cluster, path, ns)
        for pod in pods:
            await _dry_create(cluster, pod)  # admitted: no exception
        worker = next(p for p in pods if any(c.get("command", [""])[0].endswith("dynsnap-entrypoint")
                                             for c in p["spec"]["containers"]))
        bad = copy.deepcopy(worker)
        next(c for c in bad["spec"]["containers"] if c["name"] == "main")["securityContext"] = {
            "capabilities": {"add": ["CHECKPOINT_RESTORE"]}}
        with pytest.raises(ApiError) as refused:
            await _dry_create(cluster, bad)
        said = str(refused.value)
        assert refused.value.status == 403 and 'violates PodSecurity "baseline:latest"' in said, said
        assert "CHECKPOINT_RESTORE" in said, said
    finally:
        await cluster.api.delete(R.NAMESPACES, ns)
