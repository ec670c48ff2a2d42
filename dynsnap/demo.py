"""``dynsnap demo``: the main job on the local environment, told by dynsnap itself.

Brings up the real control plane (etcd, kube-apiserver, kube-controller-manager), kwok and the pod
sandboxes; installs dynsnap's CRD and the shipped RBAC; starts one node agent per fake node and the
controller, each as its own process under its own service account. Then it only applies an
annotated DynamoGraphDeployment (a Dynamo frontend and three mocker workers under
dynsnap-entrypoint, ``min-active: 1``) and a load generator, and narrates what the controller and
the agents do on their own, read from WorkerSnapshot status and Events:

1. the workers go idle and are captured down to one (quiesce: serving gate False, endpoint not
   ready, frontend no longer routing, nothing in flight; then the agent's capture steps);
2. load arrives through the frontend; the controller wakes the sleepers in place and proves each
   wake with requests pinned to it;
3. wake on request: a second graph whose only worker (the stand-in GPU engine, tier suspend,
   ``min-active: 0``, ``wake-on-request``) sleeps routable with its model still listed; one request,
   answered by the worker it woke; the wake verified;
4. a table of every capture and wake with each step's measured duration, the same as a PNG timeline
   (``--timeline-out``, default ./dynsnap-demo-timeline.png: outside the work directory, which goes
   at the end), and the checks: every request answered, every wake verified N/N, pod UIDs, IPs, DWMs
   unchanged, no liveness restart.

Tears everything down; exit 0 only if every check held.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynsnap import demo_story as S
from dynsnap.k8s.client import Kube, Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv import dynsnap_parts as DS
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, LocalCluster, wait_for
from dynsnap.testenv.netns import SandboxNetwork

DEMO_BRIDGE = "dsndemo0"
DEMO_CIDR = "10.214.0.0/16"
TIER = "snapshot"
WORKERS = 3
POLICY = {"enabled": "true", "idle-after": "4s", "tier": TIER, "min-active": "1", "verify-requests": "3",
          "wake-at-inflight": "1"}
# The last scene's graph: one worker, allowed to sleep too (wake on request, tier suspend).
WOR_POLICY = {"enabled": "true", "idle-after": "4s", "tier": "suspend", "min-active": "0", "wake-on-request": "true",
              "verify-requests": "3"}


@dataclass
class Parts:
    """What the demo started: the cluster, the agents, the controller, the stub driver."""

    cluster: LocalCluster
    driver: DS.StubDriver
    agents: list[DS.AgentProc] = field(default_factory=list)
    controller: DS.ControllerProc | None = None

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        await asyncio.gather(*(a.stop() for a in self.agents), return_exceptions=True)
        await self.cluster.stop()


async def _start(workdir: Path, tl: S.Timeline) -> Parts:
    # Its own bridge and /16, so a demo can run beside a test session's cluster (dsnbr0, 10.213/16).
    cluster = LocalCluster(workdir / "cluster", net=SandboxNetwork(bridge=DEMO_BRIDGE, cidr=DEMO_CIDR))
    tl.step("starting etcd, kube-apiserver, kube-controller-manager, kwok, sandbox network")
    await cluster.start()
    parts = Parts(cluster, DS.build_stub_driver(workdir / "stubcuda"))
    assert cluster.cp is not None
    tl.step(f"control plane up at {cluster.cp.url}; logs in {cluster.cp.logs_dir}")
    await DS.install_dynsnap(cluster)
    agent_cfg = await DS.token_kubeconfig(cluster, namespace=DS.AGENT_NS, sa=DS.AGENT_SA,
                                          path=workdir / "agent.kubeconfig")
    ctl_cfg = await DS.token_kubeconfig(cluster, namespace=DS.AGENT_NS, sa=DS.CONTROLLER_SA,
                                        path=workdir / "controller.kubeconfig")
    tl.step("installed CRD workersnapshots.dynsnap.io and the shipped RBAC (deploy/rbac/); the agents' and "
            "the controller's tokens come from the TokenRequest API")
    for node in NODES:
        a = DS.AgentProc(node, agent_cfg, workdir / f"agent-{node}", parts.driver)
        await a.start()
        parts.agents.append(a)
    parts.controller = DS.ControllerProc(ctl_cfg, workdir / "controller",
                                         extra=["--trace-file", str(workdir / "controller" / "traces.jsonl")])
    await parts.controller.start()
    tl.step(f"node agents on {', '.join(NODES)} and the controller running, each its own process "
            f"(logs in {workdir})")
    return parts


async def _deploy(parts: Parts, tl: S.Timeline) -> D.Graph:
    worker = D.mocker_component("worker", replicas=WORKERS, dynsnap=True, speedup_ratio=1,
                                env={"LD_PRELOAD": str(parts.driver.libcuda)})
    body = D.dgd("demo", [D.frontend_component(), worker])
    body["metadata"]["annotations"] = {f"{P.ANNOTATION_PREFIX}{k}": v for k, v in POLICY.items()}
    tl.step("applying DGD demo: frontend + 3 mocker workers under dynsnap-entrypoint, annotated "
            + ", ".join(f"{k}={v}" for k, v in POLICY.items()))
    graph = await D.deploy(parts.cluster, body, wait=False)
    pods = [p for ps in graph.pods.values() for p in ps]
    await asyncio.gather(*(parts.cluster.wait_ready(p.namespace, p.name, timeout=120) for p in pods))
    tl.step("all pods Ready (the controller set each worker's serving gate): "
            + ", ".join(f"{p.name}@{p.ip}" for p in pods))
    return graph


async def _capture_then_load(parts: Parts, graph: D.Graph, tl: S.Timeline, narrator: S.Narrator
                             ) -> tuple[list[str], dict[str, dict[str, Any]], list[S.LoadGen]]:
    """Scenes 1 and 2: idle workers captured down to min-active; load; every sleeper woken and verified."""
    api = parts.cluster.api
    fe = D.FrontendClient(graph.frontend)
    trickle = S.LoadGen(fe, 1, pause=3.0, max_tokens=2)
    burst = S.LoadGen(fe, 6, max_tokens=60)
    proofs: dict[str, dict[str, Any]] = {}
    try:
        await fe.wait_model()
        tl.step("phase 1: a trickle of requests (one every 3 s); idle workers are captured down to min-active")
        trickle.start()

        async def down_to_one() -> bool:
            return sum(S.asleep(w) for w in await S.snapshots(api)) == WORKERS - 1
        await wait_for("workers captured down to min-active", down_to_one, timeout=180, interval=0.5)
        sleeping = [w["metadata"]["name"] for w in await S.snapshots(api) if S.asleep(w)]
        tl.step(f"{len(sleeping)} workers asleep ({', '.join(sleeping)}); one serves the trickle")
        tl.step("phase 2: load arrives (6 concurrent clients through the frontend)")
        burst.start()

        async def all_verified() -> bool:
            for w in await S.snapshots(api):
                name = w["metadata"]["name"]
                if name in sleeping and name not in proofs and (v := S.proof_of_wake(w)) is not None:
                    proofs[name] = v
            return len(proofs) == len(sleeping)
        await wait_for("every sleeper woken and verified", all_verified, timeout=180, interval=0.5)
        await asyncio.sleep(1.0)  # a last round of answers from all three before the load stops
    finally:
        await burst.stop()
        await trickle.stop()
        await narrator.poll()
        await fe.close()
    return sleeping, proofs, [burst, trickle]


async def _check_wakes(api: Kube, tl: S.Timeline, graph: D.Graph, before: dict[str, Obj], sleeping: list[str],
                       proofs: dict[str, dict[str, Any]], loads: list[S.LoadGen]) -> None:
    snaps = {w["metadata"]["name"]: w for w in await S.snapshots(api)}
    for name in sleeping:
        v = proofs[name]
        of = "" if v["wakeId"] == snaps[name]["status"]["lastWake"]["id"] else f" (by its {v['wakeId']})"
        tl.check(v["ok"] is True and v["answered"] == v["requests"] == 3,
                 f"{name}: wake verified{of}, {v['answered']}/{v['requests']} requests pinned with "
                 f"{', '.join(v['headers'])} answered by instance {v['workerId']}")
        after = await api.get(R.PODS, name, namespace=TEST_NAMESPACE)
        ident = snaps[name]["status"]["controller"]["identity"]
        dwm = await api.get(R.DWMS, name, namespace=TEST_NAMESPACE)
        tl.check(after["metadata"]["uid"] == before[name]["metadata"]["uid"] == ident["podUID"]
                 and after["status"]["podIP"] == ident["podIP"] and dwm["metadata"]["uid"] == ident["dwmUID"],
                 f"{name}: same pod UID, pod IP and DWM UID as before it slept")
    ok = sum(x.ok for x in loads)
    failed = sum(len(x.failed) for x in loads)
    tl.check(failed == 0, f"every request through the frontend answered: {ok} ok, {failed} failed")
    tl.check(all(p.kubelet.restarts == 0 for p in graph.workers("worker")),
             "no liveness restart while workers slept")


async def _wake_on_request(parts: Parts, tl: S.Timeline, narrator: S.Narrator) -> None:
    """The last scene: a model whose only worker sleeps routable (wake on request), still listed; one
    request, answered by the worker it woke; the wake verified."""
    api = parts.cluster.api
    w = DS.engine_worker_component("engine", replicas=1, driver=parts.driver, gib=0.25, kv_gib=0.25)
    body = D.dgd("demo-wor", [D.frontend_component(), w])
    body["metadata"]["annotations"] = {f"{P.ANNOTATION_PREFIX}{k}": v for k, v in WOR_POLICY.items()}
    tl.step("phase 3: wake on request. Applying DGD demo-wor: a frontend and one worker of the stand-in "
            "GPU engine, annotated " + ", ".join(f"{k}={v}" for k, v in WOR_POLICY.items()))
    graph = await D.deploy(parts.cluster, body, wait=False)
    pods = [p for ps in graph.pods.values() for p in ps]
    await asyncio.gather(*(parts.cluster.wait_ready(p.namespace, p.name, timeout=120) for p in pods))
    pod = graph.workers("engine")[0]
    fe = D.FrontendClient(graph.frontend, timeout=120.0)
    try:
        await fe.wait_model()

        async def routable() -> Obj | None:
            ws = await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
            sus: Obj = next((c for c in (ws.get("status") or {}).get("conditions") or [] if c["type"] == "Suspended"),
                            {})
            return ws if S.asleep(ws) and sus.get("reason") == P.Reason.ROUTABLE.value else None
        ws = await wait_for("the model's last worker asleep routable", routable, timeout=120, interval=0.5)
        before = (ws["status"].get("lastWake") or {}).get("id")
        listed = await fe.model_listed()
        tl.check(listed, f"{pod.name} asleep routable (GPU memory freed, still in serving): the model is listed")
        iid = await D.instance_id(parts.cluster, pod)
        t0 = time.monotonic()
        r = await fe.chat("the first request after the sleep")
        took = time.monotonic() - t0
        tl.check(r.status == 200 and r.worker_id == iid,
                 f"one request: answered {r.status} by instance {r.worker_id} (the worker it woke) in {took:.2f}s")

        async def verified() -> Obj | None:
            ws = await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
            v = ((ws.get("status") or {}).get("controller") or {}).get("verification") or {}
            wake = (ws.get("status") or {}).get("lastWake") or {}
            return ws if wake.get("id") not in (None, before) and v.get("wakeId") == wake.get("id") and \
                v.get("ok") is not None else None
        ws = await wait_for("the wake on request verified", verified, timeout=120, interval=0.5)
        v = ws["status"]["controller"]["verification"]
        tl.check(v["ok"] is True and ws["status"]["lastWake"].get("trigger") == "request",
                 f"{pod.name}: woken by that request, wake verified {v['answered']}/{v['requests']} pinned")
    finally:
        await narrator.poll()
        await fe.close()


def _report(narrator: S.Narrator, timeline_out: Path, tl: S.Timeline) -> None:
    rows = []
    for name in sorted(narrator.history):
        for op in narrator.history[name]:
            total = sum(s["seconds"] for s in op["steps"])
            rows.append([name, op["op"], f"{total:.2f}s", S.steps(op)])
    print("\nTimeline of every capture and wake (durations measured by the controller and the agents)\n"
          + S.table(rows, ["WORKER", "OPERATION", "TOTAL", "STEPS"]) + "\n", flush=True)
    S.write_timeline(narrator, timeline_out, tl)


async def _run(workdir: Path, timeline_out: Path) -> int:
    tl = S.Timeline()
    parts: Parts | None = None
    stop_narrator = asyncio.Event()
    narrator_task: asyncio.Task[None] | None = None
    try:
        parts = await _start(workdir, tl)
        graph = await _deploy(parts, tl)
        narrator = S.Narrator(parts.cluster.api, tl)
        narrator_task = asyncio.create_task(narrator.run(stop_narrator))
        api = parts.cluster.api
        before = {p.name: await api.get(R.PODS, p.name, namespace=p.namespace) for p in graph.workers("worker")}
        sleeping, proofs, loads = await _capture_then_load(parts, graph, tl, narrator)
        await _check_wakes(api, tl, graph, before, sleeping, proofs, loads)
        await _wake_on_request(parts, tl, narrator)
        stop_narrator.set()
        _report(narrator, timeline_out, tl)
    finally:
        stop_narrator.set()
        if narrator_task is not None:
            with contextlib.suppress(Exception):
                await narrator_task
        tl.step("tearing down")
        if parts is not None:
            await parts.stop()
    if tl.failures:
        print("demo FAILED: " + "; ".join(tl.failures), file=sys.stderr)
        return 1
    tl.step("demo passed: idle -> captured -> load -> woken in place -> verified, with no request failed; "
            "and a model whose last worker slept routable answered its first request")
    return 0


def run_demo(timeline_out: Path = Path("dynsnap-demo-timeline.png")) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="dynsnap-demo-"))
    try:
        return asyncio.run(_run(workdir, timeline_out))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
