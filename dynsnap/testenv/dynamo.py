"""Dynamo graphs on the local environment: DGDs for the frontend and mocker (or stand-in engine) workers,
deployed through the stub operator into pod sandboxes, and a client for the frontend
that sends plain and pinned chat completions and reports which worker answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm, worker_ids_from
from dynsnap.testenv import stub_operator
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, LocalCluster, RunningPod, wait_for

MODEL_NAME = "tiny"
CHECKOUT = Path(__file__).resolve().parents[2]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def uncoloured(log: str) -> str:
    """A Dynamo process's log without the ANSI colour codes its tracing output carries (a pod's log as
    kubelet keeps it), so that its ``key=value`` fields can be matched."""
    return _ANSI.sub("", log)


def dynamo_python() -> str:
    py = os.environ.get("DYNSNAP_DYNAMO_PYTHON")
    if not py or not os.access(py, os.X_OK):
        raise FileNotFoundError("DYNSNAP_DYNAMO_PYTHON is not set or not executable; run `./run setup`")
    return py


def model_dir() -> str:
    d = os.environ.get("DYNSNAP_MODEL_DIR")
    if not d or not os.path.isdir(d):
        raise FileNotFoundError("DYNSNAP_MODEL_DIR is not set or missing; run `./run setup`")
    return d


def frontend_component(*, router_mode: str = "round-robin") -> Obj:
    return {"name": "Frontend", "componentType": "frontend", "replicas": 1,
            "extraPodSpec": {"mainContainer": {"command": [dynamo_python(), "-m", "dynamo.frontend"],
                                               "args": ["--http-port", str(P.DYNAMO_FRONTEND_PORT),
                                                        "--router-mode", router_mode]}}}


def entrypoint_binary() -> str:
    path = os.path.join(os.environ.get("DYNSNAP_NATIVE_BIN", "native/build"), "dynsnap-entrypoint")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} is missing; run `./run setup` (it runs make -C native)")
    return os.path.abspath(path)


def entrypoint_probes(probe_port: int = P.ENTRYPOINT_PROBE_PORT) -> Obj:
    """Container fields that point the worker's probes at dynsnap-entrypoint, as the example DGDs do."""
    def probe(path: str, period: int, failures: int) -> Obj:
        return {"httpGet": {"path": path, "port": "probe"}, "periodSeconds": period, "failureThreshold": failures,
                "timeoutSeconds": 4}
    return {"ports": [{"name": "probe", "containerPort": probe_port},
                      {"name": "system", "containerPort": P.DYNAMO_SYSTEM_PORT}],
            "startupProbe": probe("/live", 10, 60), "livenessProbe": probe("/live", 5, 1),
            "readinessProbe": probe("/health", 10, 3)}


def mocker_component(name: str, *, replicas: int, mode: str = "agg", sub: str | None = None,
                     control_dir: str | None = None, extra_pod_spec: Obj | None = None,
                     dynsnap: bool = False, env: dict[str, str] | None = None,
                     speedup_ratio: float = 100) -> Obj:
    """Mocker workers. With ``control_dir`` each runs under dynsnap-entrypoint (probes on its port)
    with that host directory as its control directory. With ``dynsnap`` they are wired for dynsnap as
    examples/dgd/ does it: the entrypoint with its control directory on an emptyDir at /run/dynsnap
    (each pod its own), probes on the entrypoint, the dynsnap.io/serving readiness gate.
    ``speedup_ratio`` divides the mocker's simulated engine time: 100 answers at once; below 1 a
    request of a few thousand tokens stays in flight for tens of seconds."""
    args = ["--model-path", model_dir(), "--model-name", MODEL_NAME, "--disaggregation-mode", mode,
            "--speedup-ratio", f"{speedup_ratio:g}"]
    return _worker_component(name, [dynamo_python(), "-m", "dynamo.mocker"], args, replicas=replicas, sub=sub,
                             control_dir=control_dir, extra_pod_spec=extra_pod_spec, dynsnap=dynsnap, env=env)


def _worker_component(name: str, command: list[str], args: list[str], *, replicas: int, sub: str | None,
                      control_dir: str | None = None, extra_pod_spec: Obj | None = None, dynsnap: bool = False,
                      env: dict[str, str] | None = None) -> Obj:
    main: Obj = {}
    extra = dict(extra_pod_spec or {})
    if dynsnap:
        control_dir = P.ENTRYPOINT_CONTROL_DIR
        extra.setdefault("readinessGates", []).append({"conditionType": P.CONDITION_SERVING})
        extra.setdefault("volumes", []).append({"name": "dynsnap-control", "emptyDir": {}})
        main["volumeMounts"] = [{"name": "dynsnap-control", "mountPath": P.ENTRYPOINT_CONTROL_DIR}]
    if control_dir is not None:
        command = [entrypoint_binary(), "--control-dir", control_dir, "--", *command]
        main.update(entrypoint_probes())
    if env:
        main["env"] = [{"name": k, "value": v} for k, v in env.items()]
    comp: Obj = {"name": name, "componentType": "worker", "replicas": replicas,
                 "extraPodSpec": {**extra, "mainContainer": {"command": command, "args": args, **main}}}
    if sub:
        comp["subComponentType"] = sub
    return comp


def dgd(name: str, components: list[Obj], *, namespace: str = TEST_NAMESPACE) -> Obj:
    return {"apiVersion": f"{P.DYNAMO_GROUP}/{P.DGD_VERSION}", "kind": "DynamoGraphDeployment",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"components": components}}


@dataclass
class Graph:
    """A deployed DGD: its object and the pods the harness runs for it."""

    dgd: Obj
    pods: dict[str, list[RunningPod]]  # component name -> pods

    @property
    def frontend(self) -> RunningPod:
        return next(p for comp in self.dgd["spec"]["components"] if comp.get("componentType") == "frontend"
                    for p in self.pods[comp["name"]])

    def workers(self, component: str) -> list[RunningPod]:
        return self.pods[component]


async def deploy(cluster: LocalCluster, body: Obj, *, timeout: float = 120, wait: bool = True) -> Graph:
    """Create the DGD, do what the operator would, run its pods, and (``wait``) wait until all are Ready."""
    api = cluster.api
    created = await api.create(R.DGDS, body)
    pods: dict[str, list[RunningPod]] = {}
    for comp in stub_operator.components(created):
        await api.create(R.SERVICES, stub_operator.component_service(created, comp))
        pods[comp["name"]] = []
        for i, pod in enumerate(stub_operator.component_pods(created, comp)):
            pod["spec"]["nodeName"] = NODES[i % len(NODES)]  # spread replicas over the fake nodes
            pods[comp["name"]].append(await cluster.run_pod(pod))
    graph = Graph(created, pods)
    if not wait:
        return graph
    await asyncio.gather(*(cluster.wait_ready(p.namespace, p.name, timeout=timeout)
                           for comp_pods in pods.values() for p in comp_pods))
    return graph


async def teardown(cluster: LocalCluster, graph: Graph) -> None:
    for comp_pods in graph.pods.values():
        for p in comp_pods:
            await cluster.delete_pod(p.namespace, p.name)
    name, ns = graph.dgd["metadata"]["name"], graph.dgd["metadata"]["namespace"]
    with contextlib.suppress(Exception):
        await cluster.api.delete(R.DGDS, name, namespace=ns, propagation="Foreground")

    # Foreground deletion finishes once the garbage collector removed what the DGD owns; a graph
    # deployed again under the same name right after (a module fixture set up twice) must not meet
    # the old one "being deleted".
    async def gone() -> bool:
        try:
            await cluster.api.get(R.DGDS, name, namespace=ns)
        except NotFound:
            return True
        return False
    with contextlib.suppress(TimeoutError):
        await wait_for(f"DGD {ns}/{name} gone", gone, timeout=60)


async def dwm_of(cluster: LocalCluster, pod: RunningPod) -> Obj:
    return await cluster.api.get(R.DWMS, pod.name, namespace=pod.namespace)


@dataclass
class ChatResult:
    status: int
    worker_id: int | None
    prefill_worker_id: int | None
    text: str
    body: Any


class HasIP(Protocol):
    """A pod with an IP: a sandboxed pod (RunningPod) or one a real node runs (real_graph.NodePod)."""

    @property
    def ip(self) -> str: ...


class FrontendClient:
    """Chat completions through the Dynamo frontend at its pod IP."""

    def __init__(self, frontend: HasIP, *, timeout: float = 30.0) -> None:
        self.base = f"http://{frontend.ip}:{P.DYNAMO_FRONTEND_PORT}"
        self.http = httpx.AsyncClient(timeout=timeout)

    async def close(self) -> None:
        await self.http.aclose()

    async def model_listed(self) -> bool:
        try:
            r = await self.http.get(f"{self.base}/v1/models")
        except httpx.TransportError:
            # Not listening yet: kwok reports a new pod Ready before the stub kubelet's first probe
            # says otherwise, so a wait can begin before the frontend's process is up.
            return False
        return r.status_code == 200 and any(m.get("id") == MODEL_NAME for m in r.json().get("data", []))

    async def wait_model(self, *, timeout: float = 60) -> None:
        await wait_for(f"model {MODEL_NAME} listed by the frontend", self.model_listed, timeout=timeout)

    async def wait_routable(self, worker_id: int, *, prefill_id: int | None = None, timeout: float = 60) -> None:
        """Wait until the frontend routes a request pinned to ``worker_id`` to it. Discovery is
        eventually consistent: the model can be listed (through one worker) before the frontend
        has seen another worker's endpoint and DWM."""
        async def routed() -> bool:
            res = await self.chat("are you there?", worker_id=worker_id, prefill_id=prefill_id, max_tokens=1)
            return res.status == 200 and res.worker_id == worker_id
        await wait_for(f"frontend routing to worker {worker_id}", routed, timeout=timeout)

    async def chat(self, prompt: str = "Hello!", *, worker_id: int | None = None, prefill_id: int | None = None,
                   max_tokens: int = 8, request_id: str | None = None) -> ChatResult:
        """One chat completion; ``request_id`` is sent as ``x-request-id``, which the frontend logs the
        request under (how a failed request's own account is found in its log)."""
        headers = {}
        if request_id is not None:
            headers["x-request-id"] = request_id
        if worker_id is not None:
            headers[P.HEADER_WORKER_INSTANCE_ID] = str(worker_id)  # decimal: hex is silently ignored
        if prefill_id is not None:
            headers[P.HEADER_PREFILL_INSTANCE_ID] = str(prefill_id)
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": False, "nvext": {"extra_fields": ["worker_id"]}}
        r = await self.http.post(f"{self.base}/v1/chat/completions", json=body, headers=headers)
        data: Any = None
        with contextlib.suppress(ValueError):
            data = r.json()
        wid, pid = worker_ids_from(data)
        text = ""
        with contextlib.suppress(Exception):
            text = data["choices"][0]["message"]["content"]
        return ChatResult(r.status_code, wid, pid, text, data)


async def instance_id(cluster: LocalCluster, pod: RunningPod) -> int:
    """The worker's discovery instance id (decimal), as its DWM publishes it. The worker applies its
    DWM in more than one write (the object first, its generate endpoint when that serves), so wait
    for the endpoint, not only the object."""
    async def published() -> int | None:
        with contextlib.suppress(ValueError):
            return instance_id_from_dwm(await dwm_of(cluster, pod))
        return None
    iid: int = await wait_for(f"DWM of {pod.name} with its generate endpoint", published, timeout=60)
    return iid
