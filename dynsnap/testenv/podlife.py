"""What the Dynamo operator and kubelet do to a worker pod's life, done when a test asks (layer: testenv).

The stub operator (``stub_operator`` through ``dynamo.deploy``) creates a graph's pods once, and the
stub kubelet only probes. Two more things the real parts do by themselves, a test here causes on
demand:

- the **operator recreates** a worker pod of its graph that was deleted: a pod of the same name
  from the component's template, on a node, with a new UID (DESIGN.md section 3.4: its instance id,
  a hash of the pod name, stays the same; everything tied to the old UID must not be reused);
- **kubelet stops the containers** of a pod that is deleted (by a person, or by the garbage
  collector once the DGD that owns it is gone): here, the pod's sandbox is stopped, and with a
  ``driver`` the stub CUDA driver forgets its processes (the real driver's state lived in them).
"""

from __future__ import annotations

import contextlib
import os

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import resources as R
from dynsnap.testenv import stub_operator
from dynsnap.testenv.cluster import LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynamo import Graph
from dynsnap.testenv.dynsnap_parts import StubDriver


async def stop_pod(cluster: LocalCluster, running: RunningPod, *, driver: StubDriver | None = None) -> None:
    """The pod's containers stopped (its sandbox), and it leaves ``cluster.pods``; with ``driver``, the
    stub driver's state of its processes dropped (StubDriver.forget_pid_namespace)."""
    cluster.pods.pop((running.namespace, running.name), None)
    inode = None
    with contextlib.suppress(OSError):
        inode = os.stat(f"/proc/{running.sandbox.pid}/ns/pid").st_ino
    await running.stop()
    if driver is not None and inode is not None:
        driver.forget_pid_namespace(inode)


def _component_of(graph: Graph, pod: RunningPod) -> str:
    for comp, pods in graph.pods.items():
        if any(p.name == pod.name and p.namespace == pod.namespace for p in pods):
            return comp
    raise KeyError(f"pod {pod.namespace}/{pod.name} is not one of the graph's")


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


async def recreate_pod(cluster: LocalCluster, graph: Graph, pod: RunningPod, *, propagation: str = "Background",
                       driver: StubDriver | None = None, timeout: float = 60) -> RunningPod:
    """The operator recreating a worker pod that was deleted.

    The pod's containers are stopped (kubelet), its API object deleted with ``propagation`` as the
    deleter asked (``Background``: the garbage collector deletes its dependents; ``Orphan``, as
    ``kubectl delete --cascade=orphan`` or a garbage collector lagging behind: they stay, without
    the owner), and once it is gone the pod of the same name is created again from the DGD's
    current component template, on the same node, and run. The new incarnation replaces the old
    one in ``graph.pods`` and is returned."""
    api = cluster.api
    comp_name = _component_of(graph, pod)
    body = await pod_again(api, graph.dgd, comp_name, pod.name, pod.node)
    running = cluster.pods.get((pod.namespace, pod.name))
    if running is not None:
        await stop_pod(cluster, running, driver=driver)
    with contextlib.suppress(NotFound):
        await api.delete(R.PODS, pod.name, namespace=pod.namespace, grace_period_seconds=0,
                         propagation=propagation, uid=pod.uid)

    await wait_pod_gone(api, pod.namespace, pod.name, pod.uid, timeout=timeout)
    new = await cluster.run_pod(body)
    graph.pods[comp_name] = [new if p.name == pod.name else p for p in graph.pods[comp_name]]
    return new


async def stop_pods_gone(cluster: LocalCluster, *, driver: StubDriver | None = None) -> list[str]:
    """kubelet's part of a pod deletion: every pod the harness runs whose API object is gone, being
    deleted, or replaced by another of its name (another UID) is stopped (``stop_pod``). Returns
    their ``namespace/name``."""
    stopped = []
    for (ns, name), running in list(cluster.pods.items()):
        try:
            live = await cluster.api.get(R.PODS, name, namespace=ns)
        except NotFound:
            live = None
        if live is None or live["metadata"]["uid"] != running.uid or live["metadata"].get("deletionTimestamp"):
            await stop_pod(cluster, running, driver=driver)
            stopped.append(f"{ns}/{name}")
    return stopped
