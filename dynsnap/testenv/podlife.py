"""What the Dynamo operator does to a worker pod's life, done when a test asks (layer: testenv).

The stub operator (``stub_operator``) creates a graph's pods once. The **operator recreates** a
worker pod of its graph that was deleted: a pod of the same name from the component's template, on a
node, with a new UID (DESIGN.md section 3.4: its instance id, a hash of the pod name, stays the same;
everything tied to the old UID must not be reused). ``real_graph.recreate`` does that on the real
node with these two; kubelet there stops the deleted pod's containers itself.
"""

from __future__ import annotations

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import resources as R
from dynsnap.testenv import stub_operator
from dynsnap.testenv.cluster import wait_for


async def pod_again(api: Kube, dgd: Obj, component: str, name: str, node: str) -> Obj:
    """The pod ``name`` of ``component`` as the operator creates it again: from the DGD's current
    component template (the DGD read afresh), bound to ``node``."""
    live = await api.get(R.DGDS, dgd["metadata"]["name"], namespace=dgd["metadata"]["namespace"])
    comp = next(c for c in stub_operator.components(live) if c["name"] == component)
    body = next(b for b in stub_operator.component_pods(live, comp) if b["metadata"]["name"] == name)
    body["spec"]["nodeName"] = node
    return body


async def wait_pod_gone(api: Kube, namespace: str, name: str, uid: str, *, timeout: float,
                        interval: float = 0.1) -> None:
    """Until the pod ``namespace/name`` of ``uid`` is gone from the API server (or another pod holds
    its name), bounded by ``timeout``."""
    async def gone() -> bool:
        try:
            live = await api.get(R.PODS, name, namespace=namespace)
        except NotFound:
            return True
        return bool(live["metadata"]["uid"] != uid)
    await wait_for(f"pod {namespace}/{name} ({uid}) gone", gone, timeout=timeout, interval=interval)
