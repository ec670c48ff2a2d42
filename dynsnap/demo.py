"""``dynsnap demo``: the main job on the local environment, with a readable timeline.

Brings up the real control plane (etcd, kube-apiserver, kube-controller-manager), kwok, and a
Dynamo frontend with two mocker workers under dynsnap-entrypoint in pod sandboxes; installs
dynsnap's CRD and the node agent's RBAC, and starts one agent per fake node as its own process
under its service account. Then it plays the controller (a later issue builds it): takes one
worker out of serving, sets its WorkerSnapshot to ``Suspended`` and watches the agent capture it
(CRIU dump onto node disk, the pod and its PID 1 staying), sets ``Active`` and watches the agent
wake it in place, and verifies the wake: same pod UID, IP, DWM UID and instance id, the
EndpointSlice endpoint ready with the same targetRef, 3/3 requests pinned to it answered by it, no
liveness restart. Every step is printed with the duration the agent measured (read from the
WorkerSnapshot's status). Tears everything down; exit 0 only if every check held.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv import dynsnap_parts as DS
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, LocalCluster, RunningPod, wait_for
from dynsnap.testenv.netns import SandboxNetwork

DEMO_BRIDGE = "dsndemo0"
DEMO_CIDR = "10.214.0.0/16"
TIER = "snapshot"


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.failures: list[str] = []

    def step(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.2f}s] {msg}", flush=True)

    def check(self, ok: bool, msg: str) -> None:
        self.step(("ok    " if ok else "FAILED") + f" {msg}")
        if not ok:
            self.failures.append(msg)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    return "\n".join(lines)


def _steps(record: dict[str, Any]) -> str:
    return ", ".join(f"{s['name']} {s['seconds']:.2f}s" for s in record.get("steps") or [])


async def _summary(cluster: LocalCluster, served: dict[str, list[str]]) -> str:
    api = cluster.api
    pods = (await api.list(R.PODS, namespace=TEST_NAMESPACE))["items"]
    dwms = (await api.list(R.DWMS, namespace=TEST_NAMESPACE))["items"]
    slices = (await api.list(R.ENDPOINT_SLICES, namespace=TEST_NAMESPACE,
                             label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true"))["items"]
    snaps = (await api.list(R.WORKER_SNAPSHOTS, namespace=TEST_NAMESPACE))["items"]
    out: list[str] = []

    def ready(p: dict[str, Any]) -> str:
        conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions") or []}
        return str(conds.get("Ready", "?"))
    out.append("Pods\n" + _table([[p["metadata"]["name"], p["metadata"]["uid"][:8], p["status"].get("podIP", ""),
                                   p["spec"].get("nodeName", ""), ready(p)] for p in pods],
                                 ["NAME", "UID", "IP", "NODE", "READY"]))
    out.append("DynamoWorkerMetadata\n" + _table(
        [[d["metadata"]["name"], d["metadata"]["uid"][:8],
          ",".join(o["uid"][:8] for o in d["metadata"].get("ownerReferences", [])),
          str(instance_id_from_dwm(d))] for d in dwms],
        ["NAME", "UID", "OWNER-POD-UID", "INSTANCE-ID"]))
    eps = [[s["metadata"]["name"], e.get("targetRef", {}).get("name", ""), ",".join(e.get("addresses", [])),
            str(e.get("conditions", {}).get("ready"))] for s in slices for e in s.get("endpoints") or []]
    out.append("EndpointSlices (discovery-enabled)\n" + _table(eps, ["SLICE", "POD", "ADDRESS", "READY"]))

    def cond(ws: Obj, t: str) -> str:
        c = next((c for c in ws.get("status", {}).get("conditions") or [] if c["type"] == t), None)
        return f"{c['status']}/{c['reason']}" if c else "-"
    out.append("WorkerSnapshots (kubectl get wsnap)\n" + _table(
        [[w["metadata"]["name"], w["spec"]["tier"], w["spec"]["desiredState"], w.get("status", {}).get("state", ""),
          cond(w, "Suspended"), cond(w, "Degraded")] for w in snaps],
        ["NAME", "TIER", "DESIRED", "STATE", "SUSPENDED", "DEGRADED"]))
    out.append("Who served what\n" + _table([[k, " ".join(v)] for k, v in served.items()], ["REQUEST", "ANSWERED BY"]))
    return "\n\n".join(out)


async def _pinned(fe: D.FrontendClient, tl: Timeline, pod: RunningPod, wid: int, served: dict[str, list[str]],
                  label: str, n: int = 3) -> None:
    got = []
    for i in range(n):
        res = await fe.chat(f"{label} {i}", worker_id=wid)
        got.append(str(res.worker_id) if res.status == 200 else f"HTTP {res.status}")
    served[f"{label} (pinned {pod.name}={wid})"] = got
    tl.check(got == [str(wid)] * n, f"{n}/{n} requests pinned to {pod.name} answered by it ({label})")


async def _ws(cluster: LocalCluster, pod: RunningPod, state: str, *, timeout: float = 120) -> Obj:
    async def reached() -> Obj | None:
        ws = await cluster.api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
        return ws if (ws.get("status") or {}).get("state") == state else None
    ws: Obj = await wait_for(f"WorkerSnapshot {pod.name} {state}", reached, timeout=timeout, interval=0.1)
    return ws


async def _run(workdir: Path) -> int:
    tl = Timeline()
    # Its own bridge and /16, so a demo can run beside a test session's cluster (dsnbr0, 10.213/16).
    cluster = LocalCluster(workdir / "cluster", net=SandboxNetwork(bridge=DEMO_BRIDGE, cidr=DEMO_CIDR))
    tl.step("starting etcd, kube-apiserver, kube-controller-manager, kwok, sandbox network")
    await cluster.start()
    served: dict[str, list[str]] = {}
    agents: list[DS.AgentProc] = []
    try:
        assert cluster.cp is not None
        tl.step(f"control plane up at {cluster.cp.url}; logs in {cluster.cp.logs_dir}")
        driver = DS.build_stub_driver(workdir / "stubcuda")
        await DS.install_dynsnap(cluster)
        kubeconfig = await DS.token_kubeconfig(cluster, namespace=DS.AGENT_NS, sa=DS.AGENT_SA,
                                               path=workdir / "agent.kubeconfig")
        tl.step("installed CRD workersnapshots.dynsnap.io and the agent's RBAC (deploy/rbac/agent.yaml); "
                "the agent's token comes from the TokenRequest API")
        body = D.dgd("demo", [D.frontend_component(), DS.worker_component("worker", replicas=2, driver=driver)])
        tl.step("applying DGD demo (frontend + 2 mocker workers under dynsnap-entrypoint) via stub_operator")
        graph = await DS.deploy_serving(cluster, body)
        tl.step("all pods Ready: " + ", ".join(f"{p.name}@{p.ip}" for ps in graph.pods.values() for p in ps))
        for node in NODES:
            a = DS.AgentProc(node, kubeconfig, workdir / f"agent-{node}", driver)
            await a.start()
            agents.append(a)
        tl.step(f"node agents running on {', '.join(NODES)} (one process each; logs in {workdir})")
        fe = D.FrontendClient(graph.frontend)
        try:
            await fe.wait_model()
            res = await fe.chat("Hello from the dynsnap demo!")
            served["chat (unpinned)"] = [str(res.worker_id)]
            tl.check(res.status == 200 and bool(res.text), f"chat completion served: {res.text!r}")
            workers = graph.workers("worker")
            ids = {p.name: await D.instance_id(cluster, p) for p in workers}
            for p in workers:
                await fe.wait_routable(ids[p.name])
            tl.step("the frontend has discovered both workers (EndpointSlice + DWM)")
            for p in workers:
                await _pinned(fe, tl, p, ids[p.name], served, "before")

            sleeper, other = workers[1], workers[0]
            await cluster.api.create(R.WORKER_SNAPSHOTS, DS.ws_body(sleeper, tier=TIER))
            ws = await _ws(cluster, sleeper, "Active")
            tl.step(f"WorkerSnapshot {sleeper.name} (tier {TIER}) accepted by the agent on {sleeper.node}: "
                    "it found the worker by its pod UID in /proc and its entrypoint's control directory")
            before_pod = await cluster.api.get(R.PODS, sleeper.name, namespace=sleeper.namespace)
            before_dwm = await cluster.api.get(R.DWMS, sleeper.name, namespace=sleeper.namespace)
            tl.step(f"quiesce {sleeper.name}: readiness gate {P.CONDITION_SERVING}=False (the controller's job)")
            await cluster.set_serving_gate(sleeper, False)
            await cluster.wait_ready(sleeper.namespace, sleeper.name, ready=False, timeout=30)
            tl.step("pod not Ready, its EndpointSlice entry not ready; desiredState: Suspended")
            await DS.set_desired(cluster.api, sleeper, "Suspended")
            ws = await _ws(cluster, sleeper, "Suspended")
            cap = ws["status"]["lastCapture"]
            image = ws["status"].get("image") or {}
            tl.step(f"agent captured it: {_steps(cap)}; image {image.get('bytes', 0) / 2**20:.0f} MiB, "
                    f"mode 0700, format {image.get('format')}; pod and its PID 1 still up")
            await _pinned(fe, tl, other, ids[other.name], served, "during sleep")
            tl.step(f"desiredState: Active (wake {sleeper.name} in place)")
            await DS.set_desired(cluster.api, sleeper, "Active")
            ws = await _ws(cluster, sleeper, "Active")
            tl.step(f"agent woke it: {_steps(ws['status']['lastWake'])}")
            await cluster.set_serving_gate(sleeper, True)
            await cluster.wait_ready(sleeper.namespace, sleeper.name, timeout=60)
            after_pod = await cluster.api.get(R.PODS, sleeper.name, namespace=sleeper.namespace)
            after_dwm = await cluster.api.get(R.DWMS, sleeper.name, namespace=sleeper.namespace)
            tl.check(after_pod["metadata"]["uid"] == before_pod["metadata"]["uid"]
                     and after_pod["status"]["podIP"] == before_pod["status"]["podIP"], "same pod UID and IP")
            tl.check(after_dwm["metadata"]["uid"] == before_dwm["metadata"]["uid"]
                     and instance_id_from_dwm(after_dwm) == ids[sleeper.name], "same DWM UID and instance id")
            ep = await cluster.endpoint_of(sleeper, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")
            tl.check(bool(ep and ep.get("conditions", {}).get("ready") and ep["targetRef"]["uid"] == sleeper.uid),
                     "its EndpointSlice endpoint is ready again, same targetRef.uid")
            await fe.wait_routable(ids[sleeper.name])
            tl.step("the frontend routes to it again: same EndpointSlice entry and DWM, no re-registration")
            await _pinned(fe, tl, sleeper, ids[sleeper.name], served, "after wake")
            tl.check(sleeper.kubelet.restarts == 0, "no liveness restart while it slept")
            print("\n" + await _summary(cluster, served) + "\n", flush=True)
        finally:
            await fe.close()
    finally:
        tl.step("tearing down")
        await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)
        await cluster.stop()
    if tl.failures:
        print("demo FAILED: " + "; ".join(tl.failures), file=sys.stderr)
        return 1
    tl.step("demo passed: suspend -> wake -> verify held")
    return 0


def run_demo() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="dynsnap-demo-"))
    try:
        return asyncio.run(_run(workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
