"""A Dynamo graph on the real node: a DynamoGraphDeployment as a user writes it (examples/dgd/), made
runnable here by a local overlay, and what the Dynamo operator would make of it created in the API
server by its stand-in (stub_operator: the Services, the graph's discovery RBAC, the pods), the pods
bound to the real node, where kubelet, containerd and runc run them from the local images.

Layer: ``dynsnap.testenv`` (test harness only).

:func:`local_overlay` changes only what cannot be as the example ships it here, each for a reason:

- the images: the local ones (hack/lib-images.sh: ``dynsnap-dynamo`` for the frontend and the
  workers, ``dynsnap-entrypoint`` for both init containers), imported into the node's containerd;
- the worker's command after the entrypoint's ``--``: Dynamo's mocker on CPU with the image's
  tokenizer-only model directory instead of vLLM and a model from the hub (no GPU, no hub here), in
  the component's role (a ``prefill`` or ``decode`` component's mocker in that disaggregation mode);
- the policy annotations the test asks for (``dynsnap.io/tier`` ...), by name;
- a memory limit on the worker container, so that a test can show the limit still holds after a wake;
- the stub driver in the GPU container, where NVIDIA's container toolkit would put the real one
  (stub_gpu_stack.with_driver).

The demo also asks for a graph name, a worker count, the mocker's speed, or the stand-in GPU engine
(:class:`Engine`) as the worker command, each named by its argument.

Nothing else: the init containers, the probes on the entrypoint, the readiness gate, the control
directory's emptyDir and the worker container's security context stay exactly as the example has them.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynsnap.k8s.client import Kube
from dynsnap.k8s.errors import Conflict, NotFound
from dynsnap.models import resources as R
from dynsnap.testenv import podlife, stub_gpu_stack, stub_operator
from dynsnap.testenv.cluster import TEST_NAMESPACE, wait_for
from dynsnap.testenv.dynamo import MODEL_NAME
from dynsnap.testenv.dynsnap_parts import StubDriver

Obj = dict[str, Any]
MODEL_DIR = "/opt/dynamo/model"  # where hack/lib-images.sh puts the model directory in dynsnap-dynamo
PACKAGE = Path(__file__).resolve().parent.parent  # this checkout's dynsnap package (the engine's code)
ENGINE_VOLUME = "stub-engine-code"
ENGINE_ROOT = "/opt/dynsnap-stub-engine"


@dataclass(frozen=True)
class NodePod:
    """A pod of the graph as the API server has it once kubelet runs it."""

    name: str
    namespace: str
    uid: str
    ip: str
    node: str


@dataclass(frozen=True)
class KubeletFacts:
    """The pod and its main container as kubelet reports them."""

    uid: str
    ip: str
    container_id: str  # without the runtime:// prefix
    restart_count: int
    ready: bool
    running: bool


async def kubelet_facts(api: Kube, pod: NodePod, container: str = "main") -> KubeletFacts:
    live = await api.get(R.PODS, pod.name, namespace=pod.namespace)
    st = live["status"]
    cs = next(c for c in st["containerStatuses"] if c["name"] == container)
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
    return KubeletFacts(live["metadata"]["uid"], st["podIP"], cs["containerID"].partition("://")[2],
                        int(cs["restartCount"]), ready, "running" in cs["state"])


@dataclass(frozen=True)
class Graph:
    dgd: Obj
    pods: dict[str, list[NodePod]]  # component name -> pods

    @property
    def frontend(self) -> NodePod:
        return next(p for c in self.dgd["spec"]["components"] if stub_operator.component_type(c) == "frontend"
                    for p in self.pods[c["name"]])

    def workers(self, component: str) -> list[NodePod]:
        return self.pods[component]


@dataclass(frozen=True)
class Engine:
    """The stand-in GPU engine (stub_engine: stands in for vLLM) as a worker of the real node: this
    checkout's ``dynsnap`` package mounted read-only from the host (a hostPath, as stub_gpu_stack gives
    the driver) and run by the image's Python, on the stub driver (it calls it per token: a request to
    a sleeping engine waits, where the mocker would answer). ``gib`` + ``kv_gib``: its device memory."""

    gib: float = 0.25
    kv_gib: float = 0.25
    extra: tuple[str, ...] = ()  # more stub_engine flags (``--no-routes``, ``--fail-route sleep``, ...)

    def args(self, mode: str | None = None) -> list[str]:
        """Its command, in ``mode`` (``prefill``/``decode``; None: aggregated)."""
        return ["python3", "-m", "dynsnap.testenv.stub_engine", "--model-path", MODEL_DIR, "--model-name",
                MODEL_NAME, "--mode", mode or "agg", "--gib", f"{self.gib:g}", "--kv-gib", f"{self.kv_gib:g}",
                *self.extra]

    def wire(self, spec: Obj, main: Obj, driver: StubDriver) -> None:
        spec.setdefault("volumes", []).append(
            {"name": ENGINE_VOLUME, "hostPath": {"path": str(PACKAGE), "type": "Directory"}})
        main.setdefault("volumeMounts", []).append(
            {"name": ENGINE_VOLUME, "mountPath": f"{ENGINE_ROOT}/dynsnap", "readOnly": True})
        main.setdefault("env", []).extend([{"name": "PYTHONPATH", "value": ENGINE_ROOT},
                                           {"name": "DYNSNAP_LIBCUDA", "value": str(driver.libcuda)}])


def mocker_args(*, speedup_ratio: float = 100, mode: str | None = None) -> list[str]:
    """The worker command after the entrypoint's ``--``: Dynamo's mocker (``python3`` is the image's venv),
    in ``mode`` (``prefill``/``decode``: the role vLLM's ``--disaggregation-mode`` gives it in
    examples/dgd/disagg.yaml; None: aggregated)."""
    role = ["--disaggregation-mode", mode] if mode else []
    return ["python3", "-m", "dynamo.mocker", "--model-path", MODEL_DIR, "--model-name", MODEL_NAME,
            "--speedup-ratio", f"{speedup_ratio:g}", *role]


def local_overlay(dgd: Obj, *, dynamo_image: str, entrypoint_image: str, driver: StubDriver,
                  policy: dict[str, str], memory_limit: str, namespace: str = TEST_NAMESPACE,
                  name: str | None = None, worker_replicas: int | None = None, speedup_ratio: float = 100,
                  engine: Engine | None = None) -> Obj:
    """``dgd`` (an examples/dgd/ graph) as it runs here; the module docstring lists every change, and
    these only when asked: the graph's ``name``, its workers' ``worker_replicas``, the mocker's
    ``speedup_ratio``, or the stand-in GPU engine instead of the mocker (``engine``)."""
    out = copy.deepcopy(dgd)
    out["metadata"]["namespace"] = namespace
    if name is not None:
        out["metadata"]["name"] = name
    out["metadata"].setdefault("annotations", {}).update(policy)
    for comp in out["spec"]["components"]:
        spec = comp["podTemplate"]["spec"]
        for init in spec.get("initContainers") or []:
            init["image"] = entrypoint_image
        for c in spec["containers"]:
            c["image"] = dynamo_image
        if stub_operator.component_type(comp) == "frontend":
            continue
        main = next(c for c in spec["containers"] if c["name"] == "main")
        if "--" not in main.get("command", []):
            raise ValueError(f"component {comp['name']}: its command does not end in the entrypoint's --")
        ctype = stub_operator.component_type(comp)
        mode = ctype if ctype in ("prefill", "decode") else None
        main["args"] = mocker_args(speedup_ratio=speedup_ratio, mode=mode) if engine is None else engine.args(mode)
        main.setdefault("resources", {}).setdefault("limits", {})["memory"] = memory_limit
        if worker_replicas is not None:
            comp["replicas"] = worker_replicas
        if engine is not None:
            engine.wire(spec, main, driver)
        comp["podTemplate"]["spec"] = stub_gpu_stack.with_driver(spec, driver)
    return out


async def _pod_running(api: Kube, namespace: str, name: str) -> Obj | None:
    pod = await api.get(R.PODS, name, namespace=namespace)
    return pod if pod.get("status", {}).get("podIP") else None


async def deploy(api: Kube, body: Obj, *, node: str, timeout: float = 180) -> Graph:
    """Create the DGD and what the operator would (its stand-in's objects), the pods bound to ``node``;
    returns once every pod has its IP from the node (not yet Ready: a dynsnap worker is Ready only
    once the controller has set its serving gate)."""
    created = await api.create(R.DGDS, body)
    for res, obj in stub_operator.discovery_rbac(created):
        with contextlib.suppress(Conflict):
            await api.create(res, obj)
    pods: dict[str, list[NodePod]] = {}
    ns = created["metadata"]["namespace"]
    for comp in stub_operator.components(created):
        await api.create(R.SERVICES, stub_operator.component_service(created, comp))
        names = []
        for pod in stub_operator.component_pods(created, comp):
            pod["spec"]["nodeName"] = node
            names.append((await api.create(R.PODS, pod))["metadata"]["name"])
        lives = await asyncio.gather(*(wait_for(f"pod {ns}/{n} running on {node}",
                                                lambda n=n: _pod_running(api, ns, n), timeout=timeout, interval=0.5)
                                       for n in names))
        pods[comp["name"]] = [NodePod(p["metadata"]["name"], ns, p["metadata"]["uid"], p["status"]["podIP"], node)
                              for p in lives]
    return Graph(created, pods)


async def teardown(api: Kube, graph: Graph, *, timeout: float = 120) -> None:
    """The DGD deleted in the foreground: the garbage collector deletes what it owns (the pods, through
    kubelet, which stops their containers), and the DGD goes once they are gone."""
    name, ns = graph.dgd["metadata"]["name"], graph.dgd["metadata"]["namespace"]
    with contextlib.suppress(NotFound):
        await api.delete(R.DGDS, name, namespace=ns, propagation="Foreground")

    async def gone() -> bool:
        left = [p for ps in graph.pods.values() for p in ps]
        for p in left:
            with contextlib.suppress(NotFound):
                await api.get(R.PODS, p.name, namespace=p.namespace)
                return False
        try:
            await api.get(R.DGDS, name, namespace=ns)
        except NotFound:
            return True
        return False
    await wait_for(f"DGD {ns}/{name} and its pods gone", gone, timeout=timeout, interval=0.5)


async def recreate(api: Kube, graph: Graph, pod: NodePod, *, driver: StubDriver, pid_ns: int,
                   timeout: float = 180) -> NodePod:
    """What the Dynamo operator does once a worker pod of its graph is deleted (by a person, ``kubectl
    delete pod``): after the pod is gone (kubelet stopped its containers and the API server removed it)
    a pod of the same name from the DGD's current component template, on the same node, with a new UID.
    The new incarnation replaces the old one in ``graph.pods`` and is returned once kubelet runs it.

    Once the old pod is gone, and before the new one exists, the stub driver forgets the processes of the
    old pod's pid namespace ``pid_ns`` (StubDriver.forget_pid_namespace: the real driver's state lived in
    those processes); kept, a new pid namespace given the same inode number would inherit it."""
    comp_name = next(c for c, ps in graph.pods.items() if any(p.name == pod.name for p in ps))
    body = await podlife.pod_again(api, graph.dgd, comp_name, pod.name, pod.node)
    await podlife.wait_pod_gone(api, pod.namespace, pod.name, pod.uid, timeout=timeout, interval=0.5)
    driver.forget_pid_namespace(pid_ns)
    await api.create(R.PODS, body)
    live = await wait_for(f"pod {pod.namespace}/{pod.name} running again on {pod.node}",
                          lambda: _pod_running(api, pod.namespace, pod.name), timeout=timeout, interval=0.5)
    new = NodePod(live["metadata"]["name"], pod.namespace, live["metadata"]["uid"], live["status"]["podIP"], pod.node)
    graph.pods[comp_name] = [new if p.name == pod.name else p for p in graph.pods[comp_name]]
    return new
