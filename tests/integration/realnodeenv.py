"""A real-node test module's environment: dynsnap installed on the real node by ``helm install``
(dynsnap/testenv/chart_node.py), and the graphs the tests deploy on it under the local overlay
(examples/dgd/agg.yaml; ``running`` deploys it for the whole module with the module's tier); the
chart's pods' logs printed if the module fails; everything torn down after, which must leave
nothing wrong behind.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import Conflict
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.models.resources import Resource
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv.chart_node import NODE, NS, RELEASE, WORKER_COMPONENT, Env, upgrade
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.fake_apiproxy import FakeApiProxy

__all__ = ["DAEMON_SETS", "DEPLOYMENTS", "NODE", "NS", "RELEASE", "SHARED_VALUES", "TWO_GPU_PROCESSES",
           "WORKER_COMPONENT", "Env", "ServingLooks", "agent_off_node", "api_server_env", "chart_pod",
           "component_policy", "controller_through_proxy", "deployed", "edit_dgd", "host_dir_mounted", "installed",
           "instance_id", "kubernetes_service", "launched_by", "running", "scale_controller", "upgrade",
           "worker_main"]

# The chart values of the install tests/integration/node/ shares, over the tests' chart_values: the
# controller's wake deadline short enough for a test to wait it out (test_controller_wake_deadline.py),
# long enough for any wake here (well under a second) and its verification on a busy 2-core machine:
# 60 s (tests assert no wall-clock time). Three CI runs hit a wake begun only at the deadline; the cause
# was the agent's, not the bound (its read of its own write hid the controller's request for the wake:
# tests/unit/test_agent_own_writes.py). The agent's bound on an
# engine route short enough to wait out a route that hangs (node/test_engine_tier.py), long enough
# for the stand-in engine's sleep and wake (a quarter of a GiB copied each way).
SHARED_VALUES: Obj = {"controller": {"wakeTimeout": 60}, "agent": {"engineRouteTimeout": 6}}


@contextlib.asynccontextmanager
async def installed(cluster: LocalCluster, work_root: Path, *, gpus: int = 2, values: Obj | None = None
                    ) -> AsyncIterator[Env]:
    """The node with dynsnap installed (``values``: more chart values) and no graph yet (the tests deploy
    theirs: :func:`deployed`)."""
    e = await chart_node.start(cluster, work_root, gpus=gpus, values=values)
    try:
        yield e
    except BaseException:
        print(await e.dump_logs())
        raise
    finally:
        problems = await chart_node.stop(e)
        assert not problems, "\n".join(problems)


def api_server_env(host: str, port: int) -> list[Obj]:
    """What a pod's in-cluster client takes for its API server (kubelet's own values otherwise)."""
    return [{"name": "KUBERNETES_SERVICE_HOST", "value": host},
            {"name": "KUBERNETES_SERVICE_PORT", "value": str(port)}]


@contextlib.asynccontextmanager
async def controller_through_proxy(env: Env, **controller: Any) -> AsyncIterator[FakeApiProxy]:
    """fake_apiproxy on the bridge's gateway, and the chart's controller reaching the API server only
    through it (``controller.extraEnv`` by ``helm upgrade``), with ``controller``'s chart values on top;
    the install as it was after."""
    cp = env.cluster.cp
    assert cp is not None
    before = copy.deepcopy(env.values)
    async with FakeApiProxy.in_front_of(cp, host=env.cluster.net.gateway) as p:
        values = copy.deepcopy(before)
        ctl = values.setdefault("controller", {})
        ctl.update(controller, extraEnv=[*ctl.get("extraEnv", []), *api_server_env(p.host, p.port)])
        await upgrade(env, values)
        try:
            yield p
        finally:
            await upgrade(env, before)


@contextlib.asynccontextmanager
async def running(cluster: LocalCluster, work_root: Path, *, tier: str) -> AsyncIterator[Env]:
    """The module's :class:`Env`, examples/dgd/agg.yaml deployed with ``dynsnap.io/tier: tier``."""
    async with installed(cluster, work_root) as e:
        await chart_node.deploy_example(e, chart_node.example_body(e, policy={"dynsnap.io/tier": tier}))
        yield e


@contextlib.asynccontextmanager
async def deployed(env: Env, body: Obj, *, ready: bool = True) -> AsyncIterator[real_graph.Graph]:
    """One test's graph: deployed Ready (chart_node.deploy_example; ``ready=False``: running), deleted with
    its pods after; if the test fails, its pods' logs are printed first (kubelet deletes them with the pods)."""
    graph = await chart_node.deploy_example(env, body, ready=ready)
    try:
        yield graph
    except BaseException:
        print(await chart_node.graph_logs(env, graph))
        raise
    finally:
        chart_node.keep_pod_logs(env)
        await real_graph.teardown(env.api, graph)
        env.graphs.remove(graph)


@dataclass
class ServingLooks:
    """kubelet's and the EndpointSlice controller's account of ``pods`` every 0.25 s while a test runs
    (at most 10 minutes): per look, each pod's ``dynsnap.io/serving`` gate, its Ready condition and its
    EndpointSlice endpoint's ``ready``, so a failed request can be set beside what was serving then."""

    env: Env
    pods: list[real_graph.NodePod]
    looks: list[tuple[float, dict[str, tuple[str, str, bool | None]]]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        ns = self.pods[0].namespace
        for _ in range(2400):
            with contextlib.suppress(Exception):
                slices = (await self.env.api.list(R.ENDPOINT_SLICES, namespace=ns))["items"]
                ep = {(e.get("targetRef") or {}).get("name"): bool((e.get("conditions") or {}).get("ready"))
                      for s in slices for e in s.get("endpoints") or []}
                look: dict[str, tuple[str, str, bool | None]] = {}
                for p in self.pods:
                    conds = {c["type"]: c["status"] for c in
                             (await self.env.api.get(R.PODS, p.name, namespace=ns))["status"].get("conditions") or []}
                    look[p.name] = (conds.get(P.CONDITION_SERVING, "-"), conds.get("Ready", "-"), ep.get(p.name))
                self.looks.append((time.time(), look))
            await asyncio.sleep(0.25)

    def around(self, t: float, lag: float = 3.0) -> str:
        """The looks within ``lag`` seconds of ``t``, one line each: name=gate/Ready/endpoint-ready."""
        return "\n".join(f"{at - t:+6.2f}s " + " ".join(f"{n}={g}/{r}/{e}" for n, (g, r, e) in look.items())
                         for at, look in self.looks if abs(at - t) <= lag)


def component_policy(body: Obj, component: str, annotations: dict[str, str]) -> Obj:
    """``body`` with ``annotations`` on ``component``'s pod template (a component's own dynsnap policy,
    where Dynamo 1.6.1's v1beta1 keeps a component's metadata); returns ``body``."""
    comp = next(c for c in body["spec"]["components"] if c["name"] == component)
    comp["podTemplate"].setdefault("metadata", {}).setdefault("annotations", {}).update(annotations)
    return body


# A worker launcher (``sh -c SCRIPT launcher MOCKER-ARGS...`` in the entrypoint's place for the worker):
# a second GPU process (``sleep``, which maps the stub driver as every process of the container does
# through LD_PRELOAD) started as the worker's child, a second rank an engine would spawn.
TWO_GPU_PROCESSES = 'sleep infinity & exec "$@"'


def worker_main(body: Obj) -> Obj:
    """The worker component's ``main`` container in ``body`` (examples/dgd/agg.yaml's), to edit in place."""
    worker = next(c for c in body["spec"]["components"] if c["name"] == WORKER_COMPONENT)
    main: Obj = next(c for c in worker["podTemplate"]["spec"]["containers"] if c["name"] == "main")
    return main


def host_dir_mounted(body: Obj, volume: str, directory: Path) -> Obj:
    """``body`` whose worker's ``main`` container mounts ``directory`` of the node read-only at the same path
    (a hostPath volume named ``volume``); returns that container, to edit further."""
    worker = next(c for c in body["spec"]["components"] if c["name"] == WORKER_COMPONENT)
    worker["podTemplate"]["spec"].setdefault("volumes", []).append(
        {"name": volume, "hostPath": {"path": str(directory), "type": "Directory"}})
    main = worker_main(body)
    main.setdefault("volumeMounts", []).append({"name": volume, "mountPath": str(directory), "readOnly": True})
    return main


def launched_by(body: Obj, script: str) -> Obj:
    """``body`` whose worker is started by ``sh -c SCRIPT`` (the mocker its arguments, as the container's
    args) in the entrypoint's place; returns ``body``."""
    main = worker_main(body)
    cmd: list[str] = main["command"]
    at = cmd.index("--") + 1  # after dynsnap-entrypoint's own arguments
    main["command"] = [*cmd[:at], "/bin/sh", "-c", script, "launcher"]
    return body


async def edit_dgd(env: Env, graph: real_graph.Graph, change: Callable[[Obj], None]) -> None:
    """What a user's ``kubectl edit`` of the graph's DGD does: read it, ``change`` it, write it back
    (read again on a conflict, at most 10 times)."""
    name, ns = graph.dgd["metadata"]["name"], graph.dgd["metadata"]["namespace"]
    for _ in range(10):
        obj = await env.api.get(R.DGDS, name, namespace=ns)
        change(obj)
        try:
            await env.api.replace(R.DGDS, obj)
            return
        except Conflict:
            continue
    raise AssertionError("10 conflicting DGD writes in a row")


async def kubernetes_service(env: Env) -> tuple[str, int]:
    """The ``kubernetes`` Service's address (cluster IP, port): the API server as a pod's sockets see it
    (stub_kube_proxy rewrites it in the pod's network namespace, as kube-proxy would)."""
    svc = await env.api.get(R.SERVICES, "kubernetes", namespace="default")
    return svc["spec"]["clusterIP"], int(svc["spec"]["ports"][0]["port"])


async def chart_pod(env: Env, component: str) -> Obj:
    """The chart's one live pod of ``component`` (``controller``, ``agent``; one not being deleted)."""
    return await env.chart_pod(component)


async def instance_id(env: Env, pod: real_graph.NodePod) -> int:
    """The worker's Dynamo instance id, from its DWM."""
    return instance_id_from_dwm(await env.api.get(R.DWMS, pod.name, namespace=pod.namespace))


DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")


async def scale_controller(env: Env, replicas: int) -> None:
    """``kubectl scale`` of the chart's controller Deployment (the chart's schema refuses
    ``controller.replicas: 0``, rightly: nobody would wake a sleeping worker); returns once its pods
    are that many, Ready, none terminating. A module that plays the controller itself scales it to 0
    with its graph deployed (the controller made its WorkerSnapshots and gates) and back to 1 after."""
    (dep,) = (await env.api.list(DEPLOYMENTS, namespace=NS, label_selector=(
        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=controller")))["items"]
    await env.api.merge_patch(DEPLOYMENTS, dep["metadata"]["name"], {"spec": {"replicas": replicas}}, namespace=NS)

    async def scaled() -> bool:
        pods = await env.chart_pods("controller")
        return len(pods) == replicas and all(chart_node.pod_ready(p) and not p["metadata"].get("deletionTimestamp")
                                             for p in pods)
    await wait_for(f"the chart's controller scaled to {replicas}", scaled, timeout=180, interval=1)


DAEMON_SETS = Resource("apps", "v1", "daemonsets", "DaemonSet")
OFF_NODE_LABEL = "dynsnap.io/test-no-such-node"  # a node label nobody sets


@contextlib.asynccontextmanager
async def agent_off_node(env: Env) -> AsyncIterator[Obj]:
    """The chart's agent DaemonSet kept off the node (a nodeSelector term no node matches, by a patch of
    the DaemonSet: its pod goes, no new one comes) for a module that runs the node's agent as a process
    of its own; yields the DaemonSet as it was. Put back after (the term removed), its new pod Ready."""
    (ds,) = (await env.api.list(DAEMON_SETS, namespace=NS, label_selector=(
        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=agent")))["items"]
    name = ds["metadata"]["name"]

    async def agent_pods(n: int) -> bool:
        pods = await env.chart_pods("agent")
        return len(pods) == n and all(chart_node.pod_ready(p) and not p["metadata"].get("deletionTimestamp")
                                      for p in pods)
    patch = {"spec": {"template": {"spec": {"nodeSelector": {OFF_NODE_LABEL: "true"}}}}}
    await env.api.merge_patch(DAEMON_SETS, name, patch, namespace=NS)
    try:
        await wait_for("the chart's agent pod gone from the node", lambda: agent_pods(0), timeout=120, interval=1)
        yield ds
    finally:
        patch = {"spec": {"template": {"spec": {"nodeSelector": {OFF_NODE_LABEL: None}}}}}
        await env.api.merge_patch(DAEMON_SETS, name, patch, namespace=NS)
        await wait_for("the chart's agent pod back on the node, Ready", lambda: agent_pods(1), timeout=180,
                       interval=1)
