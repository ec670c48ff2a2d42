"""``dynsnap demo``: the main job on the local environment, with a readable timeline.

Brings up the real control plane, kwok, and a Dynamo frontend with two mocker workers
(the second under dynsnap-entrypoint) in pod sandboxes; sends a chat request and
requests pinned to each worker through the frontend; then takes the second worker
through an in-place snapshot (quiesce, CRIU dump, restore into the same pod) and
verifies the wake by pinned requests; prints pods, DWMs, EndpointSlices and who served
what; tears everything down. Exit 0 only if every check held.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dynsnap.agent.entrypoint_control import EntrypointControl
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster, RunningPod
from dynsnap.testenv.criu import criu_dump, criu_restore
from dynsnap.testenv.netns import SandboxNetwork

DEMO_BRIDGE = "dsndemo0"
DEMO_CIDR = "10.214.0.0/16"


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


async def _summary(cluster: LocalCluster, served: dict[str, list[str]]) -> str:
    api = cluster.api
    pods = (await api.list(R.PODS, namespace=TEST_NAMESPACE))["items"]
    dwms = (await api.list(R.DWMS, namespace=TEST_NAMESPACE))["items"]
    slices = (await api.list(R.ENDPOINT_SLICES, namespace=TEST_NAMESPACE,
                             label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true"))["items"]
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
          str(D.instance_id_from_dwm(d))] for d in dwms],
        ["NAME", "UID", "OWNER-POD-UID", "INSTANCE-ID"]))
    eps = [[s["metadata"]["name"], e.get("targetRef", {}).get("name", ""), ",".join(e.get("addresses", [])),
            str(e.get("conditions", {}).get("ready"))] for s in slices for e in s.get("endpoints") or []]
    out.append("EndpointSlices (discovery-enabled)\n" + _table(eps, ["SLICE", "POD", "ADDRESS", "READY"]))
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


async def _run(workdir: Path) -> int:
    tl = Timeline()
    # Its own bridge and /16, so a demo can run beside a test session's cluster (dsnbr0, 10.213/16).
    cluster = LocalCluster(workdir / "cluster", net=SandboxNetwork(bridge=DEMO_BRIDGE, cidr=DEMO_CIDR))
    tl.step("starting etcd, kube-apiserver, kube-controller-manager, kwok, sandbox network")
    await cluster.start()
    served: dict[str, list[str]] = {}
    try:
        assert cluster.cp is not None
        tl.step(f"control plane up at {cluster.cp.url}; logs in {cluster.cp.logs_dir}")
        ctl_dir = workdir / "control-worker-1"
        ctl_dir.mkdir(mode=0o700)
        body = D.dgd("demo", [D.frontend_component(),
                              D.mocker_component("worker", replicas=1),
                              D.mocker_component("sleeper", replicas=1, control_dir=str(ctl_dir))])
        tl.step("applying DGD demo (frontend, worker, sleeper under dynsnap-entrypoint) via stub_operator")
        graph = await D.deploy(cluster, body)
        tl.step("all pods Ready: " + ", ".join(f"{p.name}@{p.ip}" for ps in graph.pods.values() for p in ps))
        fe = D.FrontendClient(graph.frontend)
        try:
            await fe.wait_model()
            res = await fe.chat("Hello from the dynsnap demo!")
            served["chat (unpinned)"] = [str(res.worker_id)]
            tl.check(res.status == 200 and bool(res.text), f"chat completion served: {res.text!r}")
            workers = graph.workers("worker") + graph.workers("sleeper")
            ids = {p.name: await D.instance_id(cluster, p) for p in workers}
            for p in workers:
                await fe.wait_routable(ids[p.name])
            tl.step("the frontend has discovered both workers (EndpointSlice + DWM)")
            for p in workers:
                await _pinned(fe, tl, p, ids[p.name], served, "before")

            sleeper = graph.workers("sleeper")[0]
            before_pod = await cluster.api.get(R.PODS, sleeper.name, namespace=sleeper.namespace)
            before_dwm = await cluster.api.get(R.DWMS, sleeper.name, namespace=sleeper.namespace)
            ep = EntrypointControl(ctl_dir)
            tl.step(f"quiesce {sleeper.name}: entrypoint state suspending (/health 503)")
            info = await ep.request(P.EntrypointState.SUSPENDING)
            await cluster.wait_ready(sleeper.namespace, sleeper.name, ready=False, timeout=30)
            tl.step("pod not Ready, EndpointSlice entry not ready; CRIU dump of the worker tree")
            images = workdir / "images-sleeper"
            dump = await criu_dump(sleeper.sandbox, int(info["worker_pid"]), images, tcp_established=True)
            await ep.request(P.EntrypointState.SNAPSHOTTED)
            size = sum(f.stat().st_size for f in images.iterdir()) / 2**20
            tl.step(f"snapshotted in {dump.seconds:.2f}s ({size:.0f} MiB); pod and its PID 1 still up")
            await _pinned(fe, tl, graph.workers("worker")[0], ids[graph.workers("worker")[0].name], served,
                          "during sleep")
            tl.step(f"wake {sleeper.name}: CRIU restore into the same pod")
            await ep.request(P.EntrypointState.RESTORING)
            restore = await criu_restore(sleeper.sandbox, images, tcp_established=True)
            await ep.request(P.EntrypointState.ACTIVE)
            await cluster.wait_ready(sleeper.namespace, sleeper.name, timeout=60)
            tl.step(f"restored in {restore.seconds:.2f}s; pod Ready again")
            after_pod = await cluster.api.get(R.PODS, sleeper.name, namespace=sleeper.namespace)
            after_dwm = await cluster.api.get(R.DWMS, sleeper.name, namespace=sleeper.namespace)
            tl.check(after_pod["metadata"]["uid"] == before_pod["metadata"]["uid"]
                     and after_pod["status"]["podIP"] == before_pod["status"]["podIP"], "same pod UID and IP")
            tl.check(after_dwm["metadata"]["uid"] == before_dwm["metadata"]["uid"]
                     and D.instance_id_from_dwm(after_dwm) == ids[sleeper.name], "same DWM UID and instance id")
            await fe.wait_routable(ids[sleeper.name])
            tl.step("the frontend routes to it again: same EndpointSlice entry and DWM, no re-registration")
            await _pinned(fe, tl, sleeper, ids[sleeper.name], served, "after wake")
            tl.check(sleeper.kubelet.restarts == 0, "no liveness restart while it slept")
            print("\n" + await _summary(cluster, served) + "\n", flush=True)
        finally:
            await fe.close()
    finally:
        tl.step("tearing down")
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
