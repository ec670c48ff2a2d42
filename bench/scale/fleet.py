"""The fleet bench/scale measures the controller against: kwok Nodes, Dynamo graphs (DGDs with
``dynsnap.io/`` annotations), the Services, pods and DWMs that Dynamo would make for them, all as
API objects only (kwok "runs" the pods: it binds them Running with an IP from their node's podCIDR).

- :func:`stub_operator_objects` stands in for the Dynamo operator: per graph, the Services and pods
  it would create (``dynsnap.testenv.stub_operator``'s labels, env and probes; workers carry the
  ``dynsnap.io/serving`` readiness gate), each pod bound to a kwok node (``spec.nodeName``);
- :func:`fake_dwm` stands in for what each Dynamo worker writes at start: its DynamoWorkerMetadata,
  named after and owned by its pod, with the ``generate`` endpoint's instance id.

Shape: each graph is disaggregated, a frontend plus a ``prefill`` component and a ``decode``
component (8 + 12 workers by default: components of realistic size); worker pods are packed 8 to a
kwok node; frontends live on nodes of their own whose pod IPs the host can reach (``stub_frontend``).

Addresses (all inside the bench's /16, e.g. 10.227.0.0/16; ``LocalCluster`` already uses .0/24 for
its gateway and node IPs and .1-.2/24 for its two nodes):
``.3.0/24`` .. ``.6.0/24`` frontend nodes' podCIDRs (254 frontends each), ``.8.0/21`` kwok node IPs,
``.16.0`` onwards one /28 per worker node (8 pods of 14 addresses).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from dynsnap.models import protocol as P
from dynsnap.testenv import stub_operator
from dynsnap.testenv.kwok import fake_node

Obj = dict[str, Any]
NAMESPACE = "scale"
MODEL = "tiny"
FRONTEND_NODES = 4  # 4 x 254 frontend pod IPs: up to 1,016 graphs


@dataclass(frozen=True)
class Shape:
    workers: int
    prefill: int = 8
    decode: int = 12
    per_node: int = 8
    idle_after: str = "20s"
    min_active: int = 1
    wake_at_inflight: int = 4

    @property
    def per_graph(self) -> int:
        return self.prefill + self.decode

    @property
    def graphs(self) -> int:
        if self.workers % self.per_graph:
            raise ValueError(f"{self.workers} workers is not a whole number of {self.per_graph}-worker graphs")
        return self.workers // self.per_graph

    @property
    def nodes(self) -> int:
        return -(-self.workers // self.per_node)


@dataclass
class Graph:
    name: str
    frontend: str  # pod name
    workers: dict[str, list[str]] = field(default_factory=dict)  # component -> pod names
    frontend_ip: str = ""
    dgd_uid: str = ""


def graph_name(i: int) -> str:
    return f"g{i:04d}"


def worker_node_name(i: int) -> str:
    return f"kw-{i:05d}"


def fe_node_name(i: int) -> str:
    return f"kw-fe-{i}"


def nodes(shape: Shape, cidr: str) -> list[Obj]:
    """kwok Nodes: the frontend nodes, then one per ``per_node`` workers."""
    net = ipaddress.IPv4Network(cidr)
    if net.prefixlen != 16:
        raise ValueError(f"the bench lays its addresses out in a /16, not {cidr}")
    base = int(net.network_address)
    out = []
    node_ips = ipaddress.IPv4Network((base + 8 * 256, 21))
    ips = node_ips.hosts()
    for i in range(FRONTEND_NODES):
        sub = ipaddress.IPv4Network((base + (3 + i) * 256, 24))
        out.append(fake_node(fe_node_name(i), pod_cidr=str(sub), node_ip=str(next(ips))))
    if 16 * 256 + shape.nodes * 16 > 65536:
        raise ValueError(f"{shape.nodes} worker nodes do not fit the /16")
    for i in range(shape.nodes):
        sub = ipaddress.IPv4Network((base + 16 * 256 + i * 16, 28))
        out.append(fake_node(worker_node_name(i), pod_cidr=str(sub), node_ip=str(next(ips))))
    return out


def policy(shape: Shape) -> dict[str, str]:
    """The DGD's dynsnap.io/ annotations (DESIGN.md section 1; dynsnap/models/policy.py)."""
    return {P.ANN_ENABLED: "true", P.ANN_IDLE_AFTER: shape.idle_after, P.ANN_TIER: "suspend",
            P.ANN_MIN_ACTIVE: str(shape.min_active), P.ANN_WAKE_AT_INFLIGHT: str(shape.wake_at_inflight),
            P.ANN_VERIFY_REQUESTS: "3", P.ANN_ON_FAILED_WAKE: "restart"}


def dgd(shape: Shape, i: int) -> Obj:
    def worker(name: str, sub: str, replicas: int) -> Obj:
        return {"name": name, "componentType": "worker", "subComponentType": sub, "replicas": replicas,
                "extraPodSpec": {"readinessGates": [{"conditionType": P.CONDITION_SERVING}],
                                 "mainContainer": {"image": "dynamo-runtime:stub",
                                                   "command": ["python3", "-m", "dynamo.mocker"]}}}
    frontend = {"name": "Frontend", "componentType": "frontend", "replicas": 1,
                "extraPodSpec": {"mainContainer": {"image": "dynamo-runtime:stub",
                                                   "command": ["python3", "-m", "dynamo.frontend"]}}}
    return {"apiVersion": f"{P.DYNAMO_GROUP}/{P.DGD_VERSION}", "kind": "DynamoGraphDeployment",
            "metadata": {"name": graph_name(i), "namespace": NAMESPACE, "annotations": policy(shape)},
            "spec": {"components": [frontend, worker("prefill", "prefill", shape.prefill),
                                    worker("decode", "decode", shape.decode)]}}


def stub_operator_objects(shape: Shape, created_dgd: Obj, graph_index: int) -> tuple[list[Obj], list[Obj], Graph]:
    """(Services, pods, graph) as the Dynamo operator would make them for one created DGD; worker pod
    ``j`` of the fleet (graph-major) goes to kwok node ``j // per_node``, the frontend to a frontend
    node. Stands in for the Dynamo operator (a Go operator not run here)."""
    g = Graph(name=created_dgd["metadata"]["name"], frontend="", dgd_uid=created_dgd["metadata"]["uid"])
    services, pods = [], []
    first_worker = graph_index * shape.per_graph
    k = 0
    for comp in stub_operator.components(created_dgd):
        services.append(stub_operator.component_service(created_dgd, comp))
        for pod in stub_operator.component_pods(created_dgd, comp):
            name = pod["metadata"]["name"]
            if comp["componentType"] == "frontend":
                pod["spec"]["nodeName"] = fe_node_name(graph_index % FRONTEND_NODES)
                g.frontend = name
            else:
                pod["spec"]["nodeName"] = worker_node_name((first_worker + k) // shape.per_node)
                g.workers.setdefault(comp["name"], []).append(name)
                k += 1
            pods.append(pod)
    return services, pods, g


def instance_id(graph_index: int, slot: int) -> int:
    """A decimal instance id per worker, unique in the fleet (Dynamo's are random 63-bit ids)."""
    return 7_000_000_000_000 + graph_index * 1000 + slot


def fake_dwm(pod: Obj, iid: int) -> Obj:
    """The DynamoWorkerMetadata a Dynamo 1.6.1 worker writes for itself (named after and owned by
    its pod; ``spec.data.endpoints`` with the ``generate`` endpoint's instance id). Stands in for the
    worker's own write (no worker runs)."""
    meta = pod["metadata"]
    ns = f"{meta['namespace']}-{meta['labels'][P.LABEL_DGD_NAME]}"
    comp = meta["labels"][P.LABEL_COMPONENT]
    return {"apiVersion": f"{P.DYNAMO_GROUP}/{P.DWM_VERSION}", "kind": "DynamoWorkerMetadata",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                              "uid": meta["uid"]}]},
            "spec": {"data": {"endpoints": {
                f"{ns}/{comp}/generate/{iid:x}": {"type": "Endpoint", "namespace": ns, "component": comp,
                                                  "endpoint": "generate", "instance_id": iid}}}}}
