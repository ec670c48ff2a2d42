"""What tests on the real node with dynsnap installed share: the node (kubelet, containerd, runc,
CNI) with the local images imported and the GPU stand-in advertised, the workload controllers and
the scheduler, dynsnap installed by ``helm install`` of deploy/helm/dynsnap (the controller
Deployment and the agent DaemonSet as pods of the node), and examples/dgd/agg.yaml under the local
overlay (real_graph.py) run by the node's kubelet; torn down in reverse, ``helm uninstall`` (its
hook wakes every worker first) included, the node leaving nothing on the host.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import resources as R
from dynsnap.models.resources import Resource
from dynsnap.testenv import dynamo as D
from dynsnap.testenv import real_graph, stub_gpu_stack
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.dynsnap_parts import ROOT, StubDriver, build_stub_driver
from dynsnap.testenv.node import REAL_NODE_LABEL, RealNode, real_node_cidr
from dynsnap.testenv.workloads import Workloads, lift_not_ready_taint

NODE = "node-real-0"
RELEASE = "dynsnap-node"  # not "dynsnap" (deploy/rbac's names, other tests) nor test_helm.py's
NS = "dynsnap-node"
CHART = ROOT / "deploy" / "helm" / "dynsnap"
EXAMPLE = ROOT / "examples" / "dgd" / "agg.yaml"
WORKER_COMPONENT = "VllmWorker"
WORKER_MEMORY_LIMIT = "2Gi"
DAEMON_SETS = Resource("apps", "v1", "daemonsets", "DaemonSet")
DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
HELM_BOUND = 300.0  # a helm command running longer than this is stuck


def images_dir() -> Path:
    d = Path(os.environ.get("DYNSNAP_IMAGES", ""))
    for name in ("dynsnap-controller", "dynsnap-agent", "dynsnap-entrypoint", "dynsnap-dynamo"):
        if not (d / name / "index.json").is_file():
            raise FileNotFoundError(f"$DYNSNAP_IMAGES has no {name} layout: run ./run setup (hack/lib-images.sh)")
    return d


@dataclass
class NodePaths:
    """The chart's host paths, overridden under the node's own directory (the run's)."""

    root: Path

    @property
    def tools(self) -> Path:  # agent.nodeToolsDir (default /var/lib/dynsnap)
        return self.root / "var-lib-dynsnap"

    @property
    def images(self) -> Path:  # agent.imagesRoot (default /var/lib/dynsnap/images)
        return self.tools / "images"

    @property
    def cuda_state(self) -> Path:  # agent.stateDir (default /run/dynsnap-cuda)
        return self.root / "run-dynsnap-cuda"


def chart_values(paths: NodePaths, driver: StubDriver) -> Obj:
    """The values a person installing dynsnap on this node would pass: the chart's defaults but for
    the host paths (under the run), the controller on the real node (the kwok nodes run nothing), the
    GPU stand-in's driver for the agent (stub_gpu_stack), and local timing. The agent's nodeSelector stays
    the chart's (nvidia.com/gpu.present, which the stand-in for GPU feature discovery sets)."""
    return {
        "controller": {"nodeSelector": {REAL_NODE_LABEL: "true"}, "scrapeInterval": 1, "verifyTimeout": 90,
                       "quiesceTimeout": 90, "verbose": True},
        "agent": {"imagesRoot": str(paths.images), "stateDir": str(paths.cuda_state), "nodeToolsDir": str(paths.tools),
                  "failureBackoff": 2, "scrapeInterval": 1, "gcInterval": 5, "verbose": True,
                  **stub_gpu_stack.agent_values(driver)},
        "uninstall": {"timeout": 120},
    }


@dataclass
class Helm:
    bin: str
    kubeconfig: Path
    home: Path

    async def run(self, *args: str, timeout: float = HELM_BOUND) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_") and k != "KUBECONFIG"}
        env |= {"KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(self.home / "cache"),
                "HELM_CONFIG_HOME": str(self.home / "config"), "HELM_DATA_HOME": str(self.home / "data")}
        proc = await asyncio.create_subprocess_exec(self.bin, *args, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"helm {' '.join(args[:2])} did not finish within {timeout:.0f}s") from None
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace")


@dataclass
class Env:
    cluster: LocalCluster
    node: RealNode
    work: Workloads
    helm: Helm
    paths: NodePaths
    driver: StubDriver
    images: dict[str, str]  # layout name -> the image name pods use
    graph: real_graph.Graph | None = None
    fe: D.FrontendClient | None = None
    logs: list[str] = field(default_factory=list)
    values: Obj = field(default_factory=dict)  # the chart values installed (or last upgraded to)

    @property
    def api(self) -> Kube:
        return self.cluster.api

    async def chart_pods(self, component: str) -> list[Obj]:
        sel = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
        return list((await self.api.list(R.PODS, namespace=NS, label_selector=sel))["items"])

    async def pod_log(self, namespace: str, name: str, container: str, *, tail: int = 80) -> str:
        """``kubectl logs``: through the API server from the node's kubelet."""
        cp = self.cluster.cp
        assert cp is not None and cp.pki is not None
        try:
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(cp.pki.ca_cert)), timeout=10,
                                         headers={"Authorization": f"Bearer {cp.identities['admin'].token}"}) as http:
                r = await http.get(f"{cp.url}/api/v1/namespaces/{namespace}/pods/{name}/log",
                                   params={"container": container, "tailLines": str(tail)})
                return r.text
        except httpx.HTTPError as e:
            return f"(no log: {e})"

    async def dump_logs(self) -> str:
        out = []
        for comp, container in (("controller", "controller"), ("agent", "agent")):
            for p in await self.chart_pods(comp):
                out.append(f"--- {p['metadata']['name']} ---\n"
                           + await self.pod_log(NS, p["metadata"]["name"], container))
        return "\n".join(out)


async def upgrade(env: Env, values: Obj) -> None:
    """``helm upgrade`` of the installed release to ``values`` (the user's next chart values)."""
    await _install(env, values, upgrade=True)


def _pod_ready(pod: Obj) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


async def _install(env: Env, values: Obj, *, upgrade: bool = False) -> None:
    """``helm install`` (or ``helm upgrade`` of the release) with ``values``; returns once the chart's
    two pods, and only they, are Ready on the node (an upgrade's replaced pods gone)."""
    vfile = env.helm.home / "values.yaml"
    vfile.write_text(yaml.safe_dump(values))
    verb = ("upgrade",) if upgrade else ("install", "--create-namespace")
    code, out = await env.helm.run(*verb, RELEASE, str(CHART), "--namespace", NS, "--values", str(vfile),
                                   "--wait", "--timeout", "240s")
    if code != 0:
        raise AssertionError(f"helm {verb[0]} failed:\n{out}\n{await env.dump_logs()}")
    env.values = values
    # helm's --wait counts a DaemonSet ready with maxUnavailable (1) pods not ready: wait for the agent.
    async def ready() -> bool:
        pods = [p for comp in ("controller", "agent") for p in await env.chart_pods(comp)]
        return len(pods) == 2 and all(_pod_ready(p) and p["spec"]["nodeName"] == NODE
                                      and not p["metadata"].get("deletionTimestamp") for p in pods)
    try:
        await wait_for("the chart's controller and agent pods Ready on the real node", ready, timeout=180,
                       interval=1)
    except TimeoutError:
        pods = [p for comp in ("controller", "agent") for p in await env.chart_pods(comp)]
        print([(p["metadata"]["name"], p["spec"].get("nodeName"), p["status"]) for p in pods])
        raise


async def _deploy_graph(env: Env, tier: str) -> None:
    body = real_graph.local_overlay(
        yaml.safe_load(EXAMPLE.read_text()), dynamo_image=env.images["dynsnap-dynamo"],
        entrypoint_image=env.images["dynsnap-entrypoint"], driver=env.driver,
        policy={"dynsnap.io/tier": tier}, memory_limit=WORKER_MEMORY_LIMIT)
    env.graph = await real_graph.deploy(env.api, body, node=NODE)
    pods = [p for ps in env.graph.pods.values() for p in ps]
    # The controller sets each new worker's serving gate; the readiness probes then make them Ready.
    try:
        await asyncio.gather(*(env.cluster.wait_ready(p.namespace, p.name, timeout=240) for p in pods))
    except TimeoutError:
        for p in pods:
            st = (await env.api.get(R.PODS, p.name, namespace=p.namespace))["status"]
            print(p.name, [(c["name"], c["state"]) for c in st.get("initContainerStatuses") or []],
                  [(c["name"], c["state"], c["restartCount"]) for c in st.get("containerStatuses") or []])
        raise
    env.fe = D.FrontendClient(env.graph.frontend)
    await env.fe.wait_model(timeout=120)


async def start(cluster: LocalCluster, work_root: Path, *, tier: str) -> Env:
    assert cluster.cp is not None
    helm_bin = os.environ.get("DYNSNAP_HELM", "")
    if not helm_bin or not os.access(helm_bin, os.X_OK):
        raise FileNotFoundError("$DYNSNAP_HELM is not set or not executable: run ./run setup")
    layouts = images_dir()
    node = RealNode(name=NODE, root=cluster.workdir / "nodes" / NODE, cp=cluster.cp, net=cluster.net,
                    api=cluster.api, pod_cidr=real_node_cidr(cluster.net))
    await node.start()
    work = Workloads(cluster.cp, work_root / "workloads")
    home = work_root / "helm"
    home.mkdir(parents=True, exist_ok=True)
    env = Env(cluster, node, work, Helm(helm_bin, cluster.cp.kubeconfig_for("admin", home / "admin.kubeconfig"), home),
              NodePaths(node.layout.root), build_stub_driver(node.layout.root / "stub-nvidia"), {})
    try:
        await stub_gpu_stack.advertise(cluster.api, NODE, gpus=2)
        for name in ("dynsnap-entrypoint", "dynsnap-controller", "dynsnap-agent", "dynsnap-dynamo"):
            ref = await node.import_image(layouts / name)
            env.images[name] = ref.removeprefix("docker.io/library/")
        await work.start()
        await lift_not_ready_taint(cluster.api, NODE)
        await _install(env, chart_values(env.paths, env.driver))
        await _deploy_graph(env, tier)
    except BaseException:
        print(await env.dump_logs())
        await stop(env)
        raise
    return env


@contextlib.asynccontextmanager
async def running(cluster: LocalCluster, work_root: Path, *, tier: str) -> AsyncIterator[Env]:
    """A test module's environment: :func:`start`, the chart's pods' logs printed if the module fails,
    and :func:`stop`, which must leave nothing wrong behind."""
    e = await start(cluster, work_root, tier=tier)
    try:
        yield e
    except BaseException:
        print(await e.dump_logs())
        raise
    finally:
        problems = await stop(e)
        assert not problems, "\n".join(problems)


async def _uninstall(env: Env) -> str:
    code, out = await env.helm.run("status", RELEASE, "-n", NS)
    if code != 0:
        return ""
    code, out = await env.helm.run("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "180s")
    if code != 0:  # the hook could not wake everything: say so, then take the release down anyway
        await env.helm.run("uninstall", RELEASE, "-n", NS, "--no-hooks", "--wait", "--timeout", "120s")
        return f"helm uninstall failed (then done without hooks):\n{out}"
    return ""


async def stop(env: Env) -> list[str]:
    """Everything down, in reverse; returns what went wrong on the way (the caller asserts it is nothing)."""
    problems: list[str] = []
    if env.fe is not None:
        await env.fe.close()
    if keep := os.environ.get("DYNSNAP_KEEP_LOGS"):  # the pods' logs, as kubelet keeps them, beside the sandboxes'
        with contextlib.suppress(OSError):
            shutil.copytree(env.node.layout.pod_logs, Path(keep) / "real-node-pods", dirs_exist_ok=True)
    if env.graph is not None:
        with contextlib.suppress(Exception):
            await real_graph.teardown(env.api, env.graph)
    with contextlib.suppress(Exception):
        if said := await _uninstall(env):
            problems.append(said)
    with contextlib.suppress(NotFound):
        await env.api.delete(R.NAMESPACES, NS)
    problems += env.work.failed() + env.node.failed()
    await env.work.stop()
    await env.node.stop()
    problems += await env.node.leftovers()
    return problems


def json_line(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
