"""dynsnap installed on the real node as a user installs it: the node (kubelet, containerd, runc,
CNI: node.py) with the local images imported and the GPU stand-in advertised (stub_gpu_stack), the
workload controllers and the scheduler (workloads.py), ``helm install`` of deploy/helm/dynsnap (the
controller Deployment and the agent DaemonSet as pods of the node), and an examples/dgd/ graph under
the local overlay (real_graph.py); torn down in reverse, ``helm uninstall`` (its hook wakes every
worker first) included, the node leaving nothing on the host.

Layer: ``dynsnap.testenv`` (test harness only). Used by ``dynsnap demo`` and by the real-node tests.

    env = await chart_node.start(cluster, workdir)      # node Ready, chart's two pods Ready
    await chart_node.deploy_example(env, chart_node.example_body(env, policy={...}))
    ...
    problems = await chart_node.stop(env)               # [] when nothing went wrong
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv import node_restart, real_graph, stub_gpu_stack
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.dynsnap_parts import ROOT, StubDriver, build_stub_driver
from dynsnap.testenv.node import REAL_NODE_LABEL, RealNode, image_stores, real_node_cidr
from dynsnap.testenv.workloads import Workloads, lift_not_ready_taint

NODE = "node-real-0"
RELEASE = "dynsnap-node"  # not "dynsnap" (deploy/rbac's names, other tests) nor test_helm.py's
NS = "dynsnap-node"
CHART = ROOT / "deploy" / "helm" / "dynsnap"
EXAMPLE = ROOT / "examples" / "dgd" / "agg.yaml"
WORKER_COMPONENT = "VllmWorker"
WORKER_MEMORY_LIMIT = "2Gi"
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
                  "failureBackoff": 2, "scrapeInterval": 1, "activityGranularity": 0, "gcInterval": 5, "verbose": True,
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
    graph: real_graph.Graph | None = None  # the graph deployed last
    graphs: list[real_graph.Graph] = field(default_factory=list)  # every graph deployed, torn down at stop
    fe: D.FrontendClient | None = None
    logs: list[str] = field(default_factory=list)
    values: Obj = field(default_factory=dict)  # the chart values installed (or last upgraded to)

    @property
    def api(self) -> Kube:
        return self.cluster.api

    async def chart_pods(self, component: str) -> list[Obj]:
        sel = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
        return list((await self.api.list(R.PODS, namespace=NS, label_selector=sel))["items"])

    async def chart_pod(self, component: str) -> Obj:
        """The chart's one live pod of ``component`` (``controller``, ``agent``; one not being deleted)."""
        pods = [p for p in await self.chart_pods(component) if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
        return pods[0]

    async def pod_log(self, namespace: str, name: str, container: str, *, tail: int = 80,
                      previous: bool = False) -> str:
        """``kubectl logs`` (``--previous``: the container's last exited run): through the API server
        from the node's kubelet."""
        cp = self.cluster.cp
        assert cp is not None and cp.pki is not None
        try:
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(cp.pki.ca_cert)), timeout=10,
                                         headers={"Authorization": f"Bearer {cp.identities['admin'].token}"}) as http:
                r = await http.get(f"{cp.url}/api/v1/namespaces/{namespace}/pods/{name}/log",
                                   params={"container": container, "tailLines": str(tail),
                                           **({"previous": "true"} if previous else {})})
        except httpx.HTTPError as e:
            return f"(no log: {e})"
        return r.text or f"(empty; kubelet's files for it: {self._log_files(namespace, name, container)})"

    def log_files(self, namespace: str, name: str, container: str) -> list[Path]:
        """The container's log files as kubelet keeps them on the node (``<ns>_<pod>_<uid>/<container>/``,
        every pod of that name), oldest run first: readable while the API server is away."""
        return sorted(f for f in self.node.layout.pod_logs.glob(f"{namespace}_{name}_*/{container}/*") if f.is_file())

    def log_on_disk(self, namespace: str, name: str, container: str) -> str:
        """:meth:`log_files` read and joined (kubelet's CRI lines: time, stream, tag, then the line)."""
        return "".join(f.read_text(errors="replace") for f in self.log_files(namespace, name, container))

    def _log_files(self, namespace: str, name: str, container: str) -> str:
        """The container's log files and their sizes: an empty answer is told apart from a log rotated
        just before it was read."""
        return ", ".join(f"{f.name} {f.stat().st_size} B" for f in self.log_files(namespace, name, container)) \
            or "none"

    async def dump_logs(self, *, tail: int = 80) -> str:
        out = []
        for comp, container in (("controller", "controller"), ("agent", "agent")):
            for p in await self.chart_pods(comp):
                name = p["metadata"]["name"]
                restarts = sum(int(c.get("restartCount") or 0)
                               for c in (p.get("status") or {}).get("containerStatuses") or [])
                if restarts:  # the run before the restart is most often the one that tells why
                    out.append(f"--- {name} (previous run; {restarts} restart(s)) ---\n"
                               + await self.pod_log(NS, name, container, previous=True))
                out.append(f"--- {name} ---\n" + await self.pod_log(NS, name, container, tail=tail))
        return "\n".join(out)


def keep_pod_logs(env: Env) -> None:
    """With ``DYNSNAP_KEEP_LOGS`` set, the node's pod logs as kubelet keeps them, copied there (beside the
    sandboxes'), before pods are deleted: kubelet removes a deleted pod's logs."""
    if keep := os.environ.get("DYNSNAP_KEEP_LOGS"):
        with contextlib.suppress(OSError):
            shutil.copytree(env.node.layout.pod_logs, Path(keep) / "real-node-pods", dirs_exist_ok=True)


async def graph_logs(env: Env, graph: real_graph.Graph, *, tail: int = 60) -> str:
    """The last ``tail`` lines of each of ``graph``'s pods' main container (``kubectl logs``), then the
    chart's controller and agent (:meth:`Env.dump_logs`)."""
    out = [f"--- {p.name} ---\n" + await env.pod_log(p.namespace, p.name, "main", tail=tail)
           for ps in graph.pods.values() for p in ps]
    return "\n".join([*out, await env.dump_logs()])


async def upgrade(env: Env, values: Obj) -> None:
    """``helm upgrade`` of the installed release to ``values`` (the user's next chart values)."""
    await _install(env, values, upgrade=True)


def _condition_true(pod: Obj, ctype: str) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == ctype and c["status"] == "True" for c in conds)


def containers_ready(pod: Obj) -> bool:
    """The pod's ContainersReady condition is True (kubelet's account of its probes, gates aside)."""
    return _condition_true(pod, "ContainersReady")


def pod_ready(pod: Obj) -> bool:
    """The pod's Ready condition is True (kubelet's account)."""
    return _condition_true(pod, "Ready")


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
        return len(pods) == 2 and all(pod_ready(p) and p["spec"]["nodeName"] == env.node.name
                                      and not p["metadata"].get("deletionTimestamp") for p in pods)
    try:
        await wait_for("the chart's controller and agent pods Ready on the real node", ready, timeout=180,
                       interval=1)
    except TimeoutError:
        pods = [p for comp in ("controller", "agent") for p in await env.chart_pods(comp)]
        print([(p["metadata"]["name"], p["spec"].get("nodeName"), p["status"]) for p in pods])
        raise


def example_body(env: Env, *, policy: dict[str, str], example: Path = EXAMPLE, **overlay: Any) -> Obj:
    """``example`` (an examples/dgd/ graph) under the local overlay with ``policy`` (real_graph.local_overlay;
    ``overlay``: its other keyword arguments)."""
    return real_graph.local_overlay(
        yaml.safe_load(example.read_text()), dynamo_image=env.images["dynsnap-dynamo"],
        entrypoint_image=env.images["dynsnap-entrypoint"], driver=env.driver, policy=policy,
        memory_limit=WORKER_MEMORY_LIMIT, **overlay)


async def deploy_example(env: Env, body: Obj, *, timeout: float = 240, ready: bool = True) -> real_graph.Graph:
    """Deploy ``body`` on the node; returns once every pod of it is Ready (the controller sets each
    new worker's serving gate, then the probes make them Ready) and its frontend lists the model
    (``ready=False``: once every pod has its IP, for a graph the controller must not serve, or one whose
    readiness the caller waits for itself with :func:`wait_graph_ready`); the graph and its frontend's
    client are ``env.graph`` and ``env.fe``."""
    # The stand-in driver's state of earlier graphs' deleted pods goes first (the real driver's went
    # with their processes): a new pod whose pid namespace reuses an inode must not inherit it.
    env.driver.forget_dead_namespaces()
    graph = await real_graph.deploy(env.api, body, node=env.node.name)
    env.graphs.append(graph)
    env.graph = graph
    if env.fe is not None:
        await env.fe.close()
    env.fe = D.FrontendClient(graph.frontend, timeout=120.0)
    if ready:
        await wait_graph_ready(env, graph, timeout=timeout)
    return graph


# kubelet v1.34's status race (kubernetes/kubernetes#139244, #138889): a readiness result that lands while
# the pod worker writes the pod's status can be lost, and the pod's status says the container not ready
# (ContainersReady False, whatever its gates say) for good while kubelet's prober says ready. Seen once in
# CI at a worker's start (test_apiserver_restart.py, 2026-12-08: ContainersReady False for 240 s, the
# serving gate True). After this long with kubelet's own log saying ready, the deploy's wait restarts
# kubelet once (what a node's operator would do; its probes start afresh) and says so.
KUBELET_STUCK_AFTER = 90.0


def kubelet_lines(env: Env, namespace: str, name: str) -> list[str]:
    """The lines of the node's kubelet log that name the pod (none where the log cannot be read)."""
    mark = f'pod="{namespace}/{name}"'
    with contextlib.suppress(OSError):
        return [x for x in (env.node.layout.logs / "kubelet.log").read_text(errors="replace").splitlines()
                if mark in x]
    return []


def kubelet_says_ready(env: Env, namespace: str, name: str) -> bool:
    """kubelet's own last word on the pod's readiness probe, in its log, is ``ready``."""
    said = [x for x in kubelet_lines(env, namespace, name) if 'probe="readiness"' in x]
    return bool(said) and 'status="ready"' in said[-1]


async def wait_graph_ready(env: Env, graph: real_graph.Graph, *, timeout: float = 240) -> None:
    """Every pod of ``graph`` Ready and its frontend (``env.fe``) listing the model; on timeout, why each
    pod is not (its containers' states and conditions, kubelet's Events of it, its log, the stand-in
    driver's states). A pod that kubelet's prober says ready while its status does not, past
    KUBELET_STUCK_AFTER, has kubelet restarted once (kubelet's race, above), loudly."""
    pods = [p for ps in graph.pods.values() for p in ps]

    async def all_ready(within: float) -> None:
        await asyncio.gather(*(env.cluster.wait_ready(p.namespace, p.name, timeout=within) for p in pods))
    try:
        try:
            await all_ready(min(timeout, KUBELET_STUCK_AFTER))
        except TimeoutError:
            if timeout <= KUBELET_STUCK_AFTER:
                raise
            stuck = [p.name for p in pods if not containers_ready(await env.api.get(R.PODS, p.name,
                                                                                    namespace=p.namespace))
                     and kubelet_says_ready(env, p.namespace, p.name)]
            if stuck:
                print(f"KUBELET RACE: kubelet's prober says {stuck} ready, their status not, after "
                      f"{KUBELET_STUCK_AFTER:.0f} s (kubernetes/kubernetes#139244): restarting kubelet")
                await node_restart.restart_kubelet(env.node)
            await all_ready(timeout - KUBELET_STUCK_AFTER)
    except TimeoutError:
        for p in pods:
            pod = await env.api.get(R.PODS, p.name, namespace=p.namespace)
            st = pod["status"]
            print(p.name, [(c["name"], c["state"]) for c in st.get("initContainerStatuses") or []],
                  [(c["name"], c["state"], c["restartCount"]) for c in st.get("containerStatuses") or []],
                  st.get("conditions"))
            if not pod_ready({"status": st}):  # why it is not Ready: what kubelet and the worker say
                print(await why_not_ready(env, pod))
        print("stub driver states (nskey -> state):", env.driver.states())
        print(await env.dump_logs(tail=400))  # the chart's controller and agent: why no gate, no WorkerSnapshot
        raise
    assert env.fe is not None
    await env.fe.wait_model(timeout=120)


def collapsed(text: str, *, head: int = 40) -> str:
    """The first ``head`` lines of ``text`` with runs of the same line (timestamps aside) told once with
    their count: a log that repeats one line every 100 ms still shows what came before it."""
    out: list[str] = []
    last, run = "", 0
    for line in text.splitlines():
        key = line.split(" ", 1)[-1]
        if key == last:
            run += 1
            continue
        if run:
            out.append(f"    (the line above {run} more times)")
        out.append(line)
        last, run = key, 0
        if len(out) >= head:
            break
    if run:
        out.append(f"    (the line above {run} more times)")
    return "\n".join(out)


async def why_not_ready(env: Env, pod: Obj) -> str:
    """Why a pod is not Ready, for a test's failure: kubelet's Events of it (the probes' failures), the
    head of its worker's log (collapsed) and its tail, and the worker's own ``/health`` answer on its
    system port (Dynamo says there which endpoint is not ready)."""
    namespace, name, ip = pod["metadata"]["namespace"], pod["metadata"]["name"], pod["status"].get("podIP")
    port = next((e.get("value") for c in pod["spec"]["containers"] for e in c.get("env") or []
                 if e["name"] == "DYN_SYSTEM_PORT"), None)
    lines = [f"--- {name}: why not Ready ---"]
    with contextlib.suppress(Exception):  # dynsnap's own account of the worker, when it has one
        ws = await env.api.get(R.WORKER_SNAPSHOTS, name, namespace=namespace)
        st = ws.get("status") or {}
        lines.append(f"WorkerSnapshot: spec {ws.get('spec')}; state {st.get('state')}; " + "; ".join(
            f"{c.get('type')}={c.get('status')} {c.get('reason')}: {c.get('message')}"
            for c in st.get("conditions") or []) + f"; controller {st.get('controller')}")
    with contextlib.suppress(Exception):
        evs = (await env.api.list(R.EVENTS, namespace=namespace,
                                  field_selector=f"regarding.name={name}"))["items"]
        lines += [f"event {e.get('reason')} x{(e.get('deprecatedCount') or 1)}: {e.get('note')}" for e in evs]
    said = [x for x in kubelet_lines(env, namespace, name) if "probe" in x or "status" in x.lower()]
    lines += ["kubelet's log of it (probes, status):", *said[-12:]]
    log = await env.pod_log(namespace, name, "main", tail=1_000_000)
    lines += ["log head:", collapsed(log), "log tail:", "\n".join(log.splitlines()[-20:])]
    if ip and port:
        try:
            async with httpx.AsyncClient(timeout=3) as http:
                r = await http.get(f"http://{ip}:{port}/health")
            lines.append(f"the worker's /health: {r.status_code} {r.text[:400]}")
        except httpx.HTTPError as e:
            lines.append(f"the worker's /health: no answer ({e!r})")
    return "\n".join(lines)


async def start(cluster: LocalCluster, work_root: Path, *, name: str = NODE, gpus: int = 2,
                values: Obj | None = None) -> Env:
    """The node ``name`` Ready with the local images imported, and dynsnap installed on it by ``helm
    install`` (the chart's controller and agent pods Ready), advertising ``gpus`` GPUs; no graph yet
    (:func:`deploy_example`). ``values``: more chart values, per section (``{"controller": {...}}``) over
    :func:`chart_values`."""
    assert cluster.cp is not None
    helm_bin = os.environ.get("DYNSNAP_HELM", "")
    if not helm_bin or not os.access(helm_bin, os.X_OK):
        raise FileNotFoundError("$DYNSNAP_HELM is not set or not executable: run ./run setup")
    layouts = images_dir()
    node = RealNode(name=name, root=cluster.workdir / "nodes" / name, cp=cluster.cp, net=cluster.net,
                    api=cluster.api, pod_cidr=real_node_cidr(cluster.net), image_stores=image_stores())
    await node.start()
    work = Workloads(cluster.cp, work_root / "workloads")
    home = work_root / "helm"
    home.mkdir(parents=True, exist_ok=True)
    env = Env(cluster, node, work, Helm(helm_bin, cluster.cp.kubeconfig_for("admin", home / "admin.kubeconfig"), home),
              NodePaths(node.layout.root), build_stub_driver(node.layout.root / "stub-nvidia"), {})
    try:
        await stub_gpu_stack.advertise(cluster.api, name, gpus=gpus)
        # Side by side: most of a first import is containerd unpacking layers file by file (a file's
        # creation costs this machine's kernel ~0.3 ms; 24k files in the Dynamo image). Into the image
        # store of an earlier node (node.image_stores), an unchanged image costs only its digests.
        names = ("dynsnap-entrypoint", "dynsnap-controller", "dynsnap-agent", "dynsnap-dynamo")
        refs = await asyncio.gather(*(node.import_image(layouts / image) for image in names))
        for image, ref in zip(names, refs, strict=True):
            env.images[image] = ref.removeprefix("docker.io/library/")
        await work.start()
        await lift_not_ready_taint(cluster.api, name)
        await namespace_gone(cluster.api, NS, timeout=120, only_terminating=True)  # an earlier install's
        base = chart_values(env.paths, env.driver)
        for section, more in (values or {}).items():
            base[section] = {**(base.get(section) or {}), **more}
        await _install(env, base)
    except BaseException:
        print(await env.dump_logs())
        await stop(env)
        raise
    return env


async def _uninstall(env: Env) -> str:
    code, out = await env.helm.run("status", RELEASE, "-n", NS)
    if code != 0:
        return ""
    code, out = await env.helm.run("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "180s")
    if code != 0:  # the hook could not wake everything: say so, then take the release down anyway
        await env.helm.run("uninstall", RELEASE, "-n", NS, "--no-hooks", "--wait", "--timeout", "120s")
        return f"helm uninstall failed (then done without hooks):\n{out}"
    return ""


async def namespace_gone(api: Kube, name: str, *, timeout: float, only_terminating: bool = False) -> None:
    """Wait until the namespace ``name`` is gone (``only_terminating``: or there and not being deleted)."""
    async def gone() -> bool:
        try:
            ns = await api.get(R.NAMESPACES, name)
        except NotFound:
            return True
        return only_terminating and not ns["metadata"].get("deletionTimestamp")
    await wait_for(f"namespace {name} gone", gone, timeout=timeout, interval=0.5)


async def stop(env: Env) -> list[str]:
    """Everything down, in reverse; returns what went wrong on the way (the caller asserts it is nothing)."""
    problems: list[str] = []
    if env.fe is not None:
        await env.fe.close()
    keep_pod_logs(env)
    for graph in reversed(env.graphs):
        with contextlib.suppress(Exception):
            await real_graph.teardown(env.api, graph)
    with contextlib.suppress(Exception):
        if said := await _uninstall(env):
            problems.append(said)
    with contextlib.suppress(NotFound):
        await env.api.delete(R.NAMESPACES, NS)
    # Gone before the node goes (kubelet confirms the deletion of the namespace's pods), so that the next
    # install of the session does not meet it Terminating ("unable to create new content in namespace").
    try:
        await namespace_gone(env.api, NS, timeout=120)
    except TimeoutError as e:
        problems.append(str(e))
    problems += env.work.failed() + env.node.failed()
    await env.work.stop()
    await env.node.stop()
    problems += await env.node.leftovers()
    return problems


