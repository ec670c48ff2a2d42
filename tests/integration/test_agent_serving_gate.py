"""The agent's serving check before a capture reads its pod informer's store, which can lag the
controller's gate write by a watch event. A stale "not False" there is confirmed from the API server
before the capture is refused (issue 18: the lag turned a harmless race into a counted failure, a
backoff and a Warning), as the agent's own identity (deploy/rbac/agent.yaml, a TokenRequest token).

The pod is a real object of the real API server on a kwok node; the stale copy is the pod as it was
read before the gate was set, which is what a lagging store holds (or, for the recreated-pod case, that
copy under another UID).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from agentenv import AGENT_NS, AGENT_SA, install_dynsnap, token_kubeconfig

from dynsnap.agent.serving import confirmed_serving_gate
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, LocalCluster

pytestmark = pytest.mark.cluster


def _pod(name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": TEST_NAMESPACE},
            "spec": {"nodeName": NODES[1], "readinessGates": [{"conditionType": P.CONDITION_SERVING}],
                     "containers": [{"name": "main", "image": "dynsnap.local/none:0"}]}}


async def _set_gate(api: Kube, name: str, value: str) -> Obj:
    obj: Obj = await api.apply(R.PODS, {"metadata": {"name": name, "namespace": TEST_NAMESPACE},
                                         "status": {"conditions": [{"type": P.CONDITION_SERVING, "status": value}]}},
                               subresource="status", field_manager=P.FIELD_MANAGER)
    return obj


async def test_a_stale_cached_gate_is_confirmed_from_the_api_server(cluster: LocalCluster) -> None:
    await install_dynsnap(cluster)
    work = Path(tempfile.mkdtemp(prefix="dynsnap-gate-"))
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    agent = await Kube.from_kubeconfig(str(kubeconfig), field_manager=P.AGENT_FIELD_MANAGER)
    name = f"gate-{uuid.uuid4().hex[:6]}"
    stale = await cluster.api.create(R.PODS, _pod(name))
    try:
        # The controller's quiesce set the gate False; the agent's store still holds the pod from before.
        await _set_gate(cluster.api, name, "False")
        serving, pod = await confirmed_serving_gate(agent, stale)
        assert serving == "False"
        assert pod["metadata"]["uid"] == stale["metadata"]["uid"]
        assert pod["metadata"]["resourceVersion"] != stale["metadata"]["resourceVersion"]
        # Really in serving: refused as before (True in the API server's copy, whatever the cache holds).
        fresh = await _set_gate(cluster.api, name, "True")
        serving, _ = await confirmed_serving_gate(agent, stale)
        assert serving == "True"
        # A False in the cache is taken as it is: no read.
        cached_false = {**fresh, "status": {"conditions": [{"type": P.CONDITION_SERVING, "status": "False"}]}}
        serving, pod = await confirmed_serving_gate(agent, cached_false)
        assert serving == "False" and pod is cached_false
        # The cache holds an earlier pod of that name (another UID): the cached answer stands, the other
        # pod's gate is not taken for it.
        await _set_gate(cluster.api, name, "False")
        earlier = {**stale, "metadata": {**stale["metadata"], "uid": str(uuid.uuid4())}}
        serving, pod = await confirmed_serving_gate(agent, earlier)
        assert serving is None and pod is earlier
    finally:
        await agent.close()
        shutil.rmtree(work, ignore_errors=True)  # the agent's token: not left behind in /tmp
        with contextlib.suppress(NotFound):
            await cluster.api.delete(R.PODS, name, namespace=TEST_NAMESPACE, grace_period_seconds=0)
