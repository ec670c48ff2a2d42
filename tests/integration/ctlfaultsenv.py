"""What the controller's fault tests (test_controller_faults.py) share beyond controllerenv.py: the node
agents and the controller as their own processes under their shipped RBAC, started once for the module
and serving one graph after another; the controller reaching the API server through fake_apiproxy (so
a test can answer its watches 410 Gone, or hold it at one step of a cycle by refusing the write of the
next); the agents with a short image GC and fake_held_criu as their CRIU; and the reads every fault
test ends on (WorkerSnapshots, the serving gate, Events, images on the nodes).

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from agentenv import AGENT_NS, AGENT_SA, AgentProc, StubDriver, build_stub_driver, install_dynsnap, token_kubeconfig
from controllerenv import cond, policy
from faultsenv import HeldCriu

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Conflict, NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynsnap_parts import CONTROLLER_SA, ControllerProc
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault
from dynsnap.testenv.podlife import stop_pod


@dataclass
class Env:
    cluster: LocalCluster
    agents: list[AgentProc]
    controller: ControllerProc
    driver: StubDriver
    held: HeldCriu
    proxy: FakeApiProxy
    work: Path

    @property
    def api(self) -> Kube:
        return self.cluster.api

    def agent_on(self, node: str) -> AgentProc:
        return next(a for a in self.agents if a.node == node)

    def controller_log(self) -> str:
        return self.controller.log_path.read_text(errors="replace")

    async def kill_controller(self) -> None:
        """SIGKILL (its pod lost without any cleanup), reaped."""
        proc = self.controller.proc
        assert proc is not None and proc.proc is not None and proc.alive(), "the controller is not running"
        self.controller.kill()
        await asyncio.wait_for(proc.proc.wait(), 30)
        self.controller.proc = None

    async def start_controller(self) -> None:
        """A new controller process (its Deployment restarting it): same identity, same log file."""
        assert self.controller.proc is None
        await self.controller.start()


def proxied_kubeconfig(src: Path, server: str, dest: Path) -> Path:
    """``src`` (a service account's kubeconfig) pointed at ``server``: the same identity, another hop."""
    cfg = yaml.safe_load(src.read_text())
    for c in cfg["clusters"]:
        c["cluster"]["server"] = server
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return dest


async def start_env(cluster: LocalCluster) -> Env:
    assert cluster.cp is not None
    work = Path(tempfile.mkdtemp(prefix="dynsnap-ctlfaults-"))
    driver = build_stub_driver(work / "stubcuda")
    held = HeldCriu.install(work)
    await install_dynsnap(cluster)
    agent_cfg = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    ctl_cfg = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=CONTROLLER_SA, path=work / "ctl.kubeconfig")
    proxy = await FakeApiProxy.in_front_of(cluster.cp).start()
    # Image GC every second (images of pods gone are deleted within a test's wait); fake_held_criu
    # runs the real CRIU and holds a dump's exit only for a pod a test names.
    agents = [AgentProc(node, agent_cfg, work / node, driver, extra=["--gc-interval", "1", "--criu", str(held.path)])
              for node in NODES]
    controller = ControllerProc(proxied_kubeconfig(ctl_cfg, proxy.url, work / "ctl-proxied.kubeconfig"),
                                work / "controller", extra=["--verify-timeout", "30", "--quiesce-timeout", "60"])
    env = Env(cluster, agents, controller, driver, held, proxy, work)
    try:
        for a in agents:
            await a.start()
        await controller.start()
    except BaseException:
        await stop_env(env)
        raise
    return env


async def stop_env(env: Env) -> None:
    env.held.release()
    await env.controller.stop()
    await asyncio.gather(*(a.stop() for a in env.agents), return_exceptions=True)
    await env.proxy.stop()


# -- graphs ---------------------------------------------------------------------------------------------------

def graph_body(name: str, driver: StubDriver, *, dgd: dict[str, str], worker: dict[str, str],
               replicas: int = 2) -> Obj:
    """A frontend and ``replicas`` mocker workers (the stub driver mapped) with these annotations."""
    comp = D.mocker_component("worker", replicas=replicas, dynsnap=True, speedup_ratio=1,
                              env={"LD_PRELOAD": str(driver.libcuda)})
    comp["annotations"] = dict(worker)
    body = D.dgd(name, [D.frontend_component(), comp])
    body["metadata"]["annotations"] = dict(dgd)
    return body


def standard(*, tier: str = "suspend", idle_after: str = "2s", min_active: int = 1) -> tuple[dict[str, str],
                                                                                            dict[str, str]]:
    """(DGD annotations, worker component annotations) of an opted-in graph."""
    return (policy(enabled=True, idle_after=idle_after, tier=tier, wake_at_inflight=1),
            policy(min_active=min_active, verify_requests=2))


@dataclass
class Deployed:
    graph: D.Graph
    fe: D.FrontendClient

    @property
    def workers(self) -> list[RunningPod]:
        return self.graph.workers("worker")

    @property
    def name(self) -> str:
        return str(self.graph.dgd["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.graph.dgd["metadata"]["namespace"])


async def deploy(env: Env, body: Obj, *, ready: bool = True) -> Deployed:
    """The graph through the stub operator; with ``ready``, wait until the controller has let every
    worker serve (its gate True: Ready) and the frontend lists the model."""
    graph = await D.deploy(env.cluster, body, wait=False)
    fe = D.FrontendClient(graph.frontend)
    if ready:
        try:
            pods = [p for ps in graph.pods.values() for p in ps]
            await asyncio.gather(*(env.cluster.wait_ready(p.namespace, p.name, timeout=120) for p in pods))
            await fe.wait_model()
        except BaseException:
            await undeploy(env, Deployed(graph, fe))
            raise
    return Deployed(graph, fe)


async def undeploy(env: Env, g: Deployed) -> None:
    """The graph's pods stopped (the stub driver forgets their processes: a later pod must not inherit
    their checkpoint state), then torn down."""
    await g.fe.close()
    for p in [p for ps in g.graph.pods.values() for p in ps]:
        running = env.cluster.pods.get((p.namespace, p.name))
        if running is not None and running.uid == p.uid:
            await stop_pod(env.cluster, running, driver=env.driver)
    await D.teardown(env.cluster, g.graph)


async def edit_annotations(api: Kube, g: Deployed, *, dgd: dict[str, str | None] | None = None,
                           component: dict[str, str | None] | None = None, comp_name: str = "worker") -> Obj:
    """What a user's ``kubectl edit`` of the DGD does: read, change annotations (None removes one), write
    back with the resourceVersion read (a conflict is read and tried again)."""
    for _ in range(10):
        obj = await api.get(R.DGDS, g.name, namespace=g.namespace)
        ann = obj["metadata"].setdefault("annotations", {})
        for k, v in (dgd or {}).items():
            ann.pop(k, None) if v is None else ann.__setitem__(k, v)
        comp = next(c for c in obj["spec"]["components"] if c["name"] == comp_name)
        cann = comp.setdefault("annotations", {})
        for k, v in (component or {}).items():
            cann.pop(k, None) if v is None else cann.__setitem__(k, v)
        try:
            written: Obj = await api.replace(R.DGDS, obj)
            return written
        except Conflict:
            continue
    raise AssertionError(f"DGD {g.name}: 10 conflicting writes in a row")


async def set_override(api: Kube, pod: RunningPod, value: str | None) -> None:
    """``dynsnap suspend|wake POD`` (the pod's dynsnap.io/desired-state); None takes it away."""
    await api.merge_patch(R.PODS, pod.name, {"metadata": {"annotations": {P.ANN_DESIRED_STATE: value}}},
                          namespace=pod.namespace)


# -- reads ---------------------------------------------------------------------------------------------------

async def get_pod(api: Kube, pod: RunningPod) -> Obj | None:
    with contextlib.suppress(NotFound):
        return await api.get(R.PODS, pod.name, namespace=pod.namespace)
    return None


def pod_condition(pod: Obj | None, ctype: str) -> str | None:
    return next((c["status"] for c in ((pod or {}).get("status") or {}).get("conditions") or []
                 if c["type"] == ctype), None)


def record(ws: Obj | None) -> dict[str, Any]:
    """The controller's part of a WorkerSnapshot's status."""
    rec: dict[str, Any] = ((ws or {}).get("status") or {}).get("controller") or {}
    return rec


def suspended(ws: Obj | None) -> bool:
    c = cond(ws, "Suspended")
    return bool(ws and ws["spec"]["desiredState"] == "Suspended" and (ws.get("status") or {}).get("state") ==
                "Suspended" and c and c["status"] == "True")


def verified_wake(ws: Obj | None) -> bool:
    """Awake, and its latest wake proven: Verified=True for the lastWake it names."""
    st = (ws or {}).get("status") or {}
    v = record(ws).get("verification") or {}
    c = cond(ws, "Verified")
    return bool(ws and ws["spec"]["desiredState"] == "Active" and st.get("state") == "Active"
                and v.get("ok") is True and st.get("lastWake") and v.get("wakeId") == st["lastWake"].get("id")
                and c and c["status"] == "True")


async def eventually(what: str, check: Callable[[], Awaitable[Any]], timeout: float = 120) -> Any:
    return await wait_for(what, check, timeout=timeout, interval=0.2)


async def events(api: Kube, namespace: str, *, name: str, kind: str | None = None,
                 reason: str | None = None) -> list[Obj]:
    evs = await api.list(R.EVENTS, namespace=namespace)
    return [e for e in evs.get("items", []) if (e.get("regarding") or {}).get("name") == name
            and (kind is None or (e.get("regarding") or {}).get("kind") == kind)
            and (reason is None or e.get("reason") == reason)]


def image_dir(env: Env, pod: RunningPod) -> Path:
    """Where the pod's node agent keeps its captures (one directory per pod UID)."""
    return env.agent_on(pod.node).images_root / f"{pod.namespace}_{pod.name}_{pod.uid}"


def refuse(env: Env, *, method: str, path: str) -> Fault:
    """Refuse the controller's requests to exactly ``path`` with 503 until cleared: it stays at the step
    before that write (each reconcile retried, failing there)."""
    return env.proxy.add(Fault("respond", method=method, path_equals=path, status=503, times=None))


def ws_path(pod: RunningPod, *, status: bool = False) -> str:
    """The path of the worker's WorkerSnapshot (its spec: desiredState; or its status)."""
    return R.WORKER_SNAPSHOTS.path(namespace=pod.namespace, name=pod.name, subresource="status" if status else None)


def gate_path(pod: RunningPod) -> str:
    """The path the serving gate is written to (the pod's status)."""
    return R.PODS.path(namespace=pod.namespace, name=pod.name, subresource="status")
