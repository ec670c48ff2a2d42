"""``dynsnap demo``: the main job on a real node of the local environment, told by dynsnap itself.

Brings up the real control plane (etcd, kube-apiserver, kube-controller-manager) and a real node
(kubelet, containerd, runc, the CNI plugins; dynsnap/testenv/node.py) on its own bridge, imports the
local images into the node's containerd and installs dynsnap as a user would, ``helm install`` of
deploy/helm/dynsnap (the controller Deployment and the agent DaemonSet, root in the host's pid namespace
with CRIU's capabilities, as pods of that node, under the chart's RBAC). Then it only applies
examples/dgd/agg.yaml under the local overlay (real_graph.py: local images, Dynamo's mocker on CPU; here
three workers and the demo's policy: ``idle-after: 4s``, ``min-active: 1``) and a load generator, and
narrates what the controller and the agent do on their own, read from WorkerSnapshot status, Events and
the kubelet's pod status:

1. the workers go idle and are captured down to one (quiesce: serving gate False, endpoint not
   ready, frontend no longer routing, nothing in flight; then the agent's capture steps);
2. load arrives through the frontend; the controller wakes the sleepers in place and proves each
   wake with requests pinned to it;
3. wake on request: a second graph from the same example whose only worker (the stand-in GPU engine,
   tier suspend, ``min-active: 0``, ``wake-on-request``) sleeps routable with its model still listed;
   one request, answered by the worker it woke; the wake verified;
4. a table of every capture and wake with each step's measured duration, the same as a PNG timeline
   (``--timeline-out``, default ./dynsnap-demo-timeline.png: outside the work directory, which goes
   at the end), and the checks: every request answered, every wake verified N/N, pod UIDs, IPs, DWMs
   unchanged; and the kubelet's own facts for every worker: the same container id, restartCount
   unchanged, Ready False and True again only through the serving gate;
5. ``helm uninstall`` (its hook wakes whatever still sleeps), the node stopped, nothing left behind.

Exit 0 only if every check held.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dynsnap import demo_story as S
from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node
from dynsnap.testenv.chart_node import WORKER_COMPONENT, Env
from dynsnap.testenv.cluster import TEST_NAMESPACE, LocalCluster, wait_for
from dynsnap.testenv.netns import SandboxNetwork
from dynsnap.testenv.real_graph import Engine, Graph

DEMO_BRIDGE = "dsndemo0"
DEMO_CIDR = "10.214.0.0/16"
TIER = "snapshot"
WORKERS = 3
POLICY = {"enabled": "true", "idle-after": "4s", "tier": TIER, "min-active": "1", "verify-requests": "3",
          "wake-at-inflight": "1"}
# The last scene's graph: one worker, allowed to sleep too (wake on request, tier suspend).
WOR_POLICY = {"enabled": "true", "idle-after": "4s", "tier": "suspend", "min-active": "0", "wake-on-request": "true",
              "verify-requests": "3"}


def _annotations(policy: dict[str, str]) -> dict[str, str]:
    return {f"{P.ANNOTATION_PREFIX}{k}": v for k, v in policy.items()}


async def _start(cluster: LocalCluster, workdir: Path, tl: S.Timeline) -> Env:
    """The control plane, then the node with dynsnap installed by helm (chart_node.start)."""
    tl.step("starting etcd, kube-apiserver, kube-controller-manager")
    await cluster.start()
    assert cluster.cp is not None
    tl.step(f"control plane up at {cluster.cp.url}; logs in {cluster.cp.logs_dir}")
    tl.step("starting a real node (containerd + runc + CNI bridge + kubelet), importing the local images, "
            "then helm install deploy/helm/dynsnap")
    # A GPU each: the three workers of the first graph and the engine of the last scene's.
    return await chart_node.start(cluster, workdir, gpus=WORKERS + 1)


async def _describe(env: Env, tl: S.Timeline) -> None:
    node = await env.api.get(R.NODES, env.node.name)
    info = node["status"]["nodeInfo"]
    tl.step(f"node {env.node.name} Ready: kubelet {info['kubeletVersion']}, {info['containerRuntimeVersion']}; "
            f"logs in {env.node.layout.logs}")
    pods = [p for comp in ("controller", "agent") for p in await env.chart_pods(comp)]
    tl.step("helm install done: " + ", ".join(f"{p['metadata']['name']} ({p['spec']['containers'][0]['image']})"
                                              for p in pods) + f" Ready on {env.node.name}")


async def _deploy(env: Env, tl: S.Timeline) -> Graph:
    """The graph's pods created and running on the node, not yet Ready (:func:`_until_ready`)."""
    body = chart_node.example_body(env, policy=_annotations(POLICY), name="demo", worker_replicas=WORKERS,
                                   speedup_ratio=1)
    tl.step(f"applying examples/dgd/agg.yaml as DGD demo (local images, the mocker, {WORKERS} workers), annotated "
            + ", ".join(f"{k}={v}" for k, v in POLICY.items()))
    return await chart_node.deploy_example(env, body, ready=False)


async def _until_ready(env: Env, graph: Graph, tl: S.Timeline) -> None:
    """Every pod of ``graph`` Ready and its frontend listing the model. The kubelet's account is watched
    from before this: with ``idle-after: 4s`` the controller may take an idle worker out of serving
    before a first look taken only now (seen under load: the first state a watch begun here saw was
    already gate False/Ready False)."""
    await chart_node.wait_graph_ready(env, graph)
    pods = [p for ps in graph.pods.values() for p in ps]
    tl.step("all pods Ready on the node (the controller set each worker's serving gate): "
            + ", ".join(f"{p.name}@{p.ip}" for p in pods))


async def _capture_then_load(env: Env, tl: S.Timeline, narrator: S.Narrator
                             ) -> tuple[list[str], dict[str, dict[str, Any]], list[S.LoadGen]]:
    """Scenes 1 and 2: idle workers captured down to min-active; load; every sleeper woken and verified."""
    api = env.api
    assert env.fe is not None
    fe = env.fe
    trickle = S.LoadGen(fe, 1, pause=3.0, max_tokens=2, name="trickle")
    burst = S.LoadGen(fe, 6, max_tokens=60, name="burst")
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
    return sleeping, proofs, [burst, trickle]


async def _check_wakes(env: Env, graph: Graph, tl: S.Timeline, before: dict[str, Obj], sleeping: list[str],
                       proofs: dict[str, dict[str, Any]], loads: list[S.LoadGen]) -> None:
    api = env.api
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
    failures = [f"{x.clients} client(s) {f}" for x in loads for f in x.failed]
    said = "".join(f"\n    {f}" for f in failures[:5])
    if failures:  # what the frontend itself says about each (its log, by x-request-id)
        fe = graph.frontend
        log = await env.pod_log(fe.namespace, fe.name, "main", tail=5000)
        ids = [rid for x in loads for rid in x.failed_ids][:5]
        said += "\n  the frontend's account:" + "".join(f"\n    {a}" for a in S.frontend_account(log, ids))
    tl.check(not failures, f"every request through the frontend answered: {ok} ok, {len(failures)} failed{said}")


def _check_kubelet(tl: S.Timeline, watch: S.KubeletWatch, slept: set[str], *, why_ready: str = "") -> None:
    """The kubelet's facts: one container, never restarted; out of serving only through the gate (the
    workers in ``slept``), or Ready all along (the others; ``why_ready`` says why where they slept)."""
    for name in sorted(watch.pods):
        seen = sorted(watch.containers[name])
        if len(seen) == 1:
            cid, restarts = seen[0]
            tl.check(restarts == 0, f"{name}: kubelet reports one container {cid[:25]}... restartCount {restarts} "
                     f"in {watch.looks} looks")
        else:
            tl.check(False, f"{name}: kubelet reported containers {seen}")
        since = watch.since_ready(name)  # from the first look that saw it Ready
        states = " -> ".join(f"gate {g}/Ready {r}" for g, r in since)
        if name in slept:  # through_gate: back in serving after a not-Ready state, only ever out by the gate
            tl.check(watch.through_gate(name),
                     f"{name}: Ready False and True again only through the serving gate ({states})")
        else:
            tl.check(bool(since) and all(r for _, r in since),
                     f"{name}: Ready all along{why_ready} ({states or 'never seen Ready'})")


async def _wake_on_request(env: Env, tl: S.Timeline, narrator: S.Narrator) -> S.KubeletWatch:
    """The last scene: a model whose only worker sleeps routable (wake on request), still listed; one
    request, answered by the worker it woke; the wake verified."""
    api = env.api
    body = chart_node.example_body(env, policy=_annotations(WOR_POLICY), name="demo-wor", worker_replicas=1,
                                   engine=Engine(gib=0.25, kv_gib=0.25))
    tl.step("phase 3: wake on request. Applying examples/dgd/agg.yaml as DGD demo-wor: a frontend and one worker "
            "of the stand-in GPU engine, annotated " + ", ".join(f"{k}={v}" for k, v in WOR_POLICY.items()))
    graph = await chart_node.deploy_example(env, body)
    pod = graph.workers(WORKER_COMPONENT)[0]
    watch = S.KubeletWatch(api, {pod.name: pod.namespace})
    stop = asyncio.Event()
    task = asyncio.create_task(watch.run(stop))
    assert env.fe is not None
    fe = env.fe
    try:
        async def routable() -> Obj | None:
            ws = await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
            sus: Obj = next((c for c in (ws.get("status") or {}).get("conditions") or [] if c["type"] == "Suspended"),
                            {})
            return ws if S.asleep(ws) and sus.get("reason") == P.Reason.ROUTABLE.value else None
        ws = await wait_for("the model's last worker asleep routable", routable, timeout=120, interval=0.5)
        before = (ws["status"].get("lastWake") or {}).get("id")
        listed = await fe.model_listed()
        await watch.look()
        ready = watch.states[pod.name][-1][1]
        tl.check(listed and ready, f"{pod.name} asleep routable (GPU memory freed, still in serving): the model is "
                 f"listed, kubelet has the pod Ready={ready}")
        iid = instance_id_from_dwm(await api.get(R.DWMS, pod.name, namespace=pod.namespace))
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
        stop.set()
        await task
        await narrator.poll()
    return watch


def _report(narrator: S.Narrator, timeline_out: Path, tl: S.Timeline) -> None:
    rows = []
    for name in sorted(narrator.history):
        for op in narrator.history[name]:
            total = sum(s["seconds"] for s in op["steps"])
            rows.append([name, op["op"], f"{total:.2f}s", S.steps(op)])
    print("\nTimeline of every capture and wake (durations measured by the controller and the agents)\n"
          + S.table(rows, ["WORKER", "OPERATION", "TOTAL", "STEPS"]) + "\n", flush=True)
    S.write_timeline(narrator, timeline_out, tl)


async def _teardown(cluster: LocalCluster, env: Env | None, tl: S.Timeline) -> None:
    if env is not None:
        tl.step("tearing down: the graphs deleted (kubelet stops their pods), helm uninstall (its hook wakes "
                "whatever still sleeps), the node stopped")
        problems = await chart_node.stop(env)
        tl.check(not problems, "helm uninstall done and the node left nothing behind" if not problems
                 else "teardown: " + "; ".join(problems))
    await cluster.stop()


async def _run(workdir: Path, timeline_out: Path) -> int:
    tl = S.Timeline()
    # Its own bridge and /16, so a demo can run beside a test session's cluster (dsnbr0, 10.213/16).
    cluster = LocalCluster(workdir / "cluster", net=SandboxNetwork(bridge=DEMO_BRIDGE, cidr=DEMO_CIDR),
                           fake_nodes=False)
    env: Env | None = None
    stop_watching = asyncio.Event()
    stop_kubelet = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        env = await _start(cluster, workdir, tl)
        await _describe(env, tl)
        graph = await _deploy(env, tl)
        api = env.api
        narrator = S.Narrator(api, tl)
        workers = graph.workers(WORKER_COMPONENT)
        watch = S.KubeletWatch(api, {p.name: p.namespace for p in workers})
        await watch.look()
        # kubelet's account of scenes 1 and 2, from before the pods are Ready (after the scenes, idle
        # again, the workers may well sleep again)
        kubelet_task = asyncio.create_task(watch.run(stop_kubelet))
        tasks = [asyncio.create_task(narrator.run(stop_watching)), kubelet_task]
        await _until_ready(env, graph, tl)
        before = {p.name: await api.get(R.PODS, p.name, namespace=p.namespace) for p in workers}
        sleeping, proofs, loads = await _capture_then_load(env, tl, narrator)
        await _check_wakes(env, graph, tl, before, sleeping, proofs, loads)
        stop_kubelet.set()
        await kubelet_task
        await watch.look()
        _check_kubelet(tl, watch, set(sleeping))
        wor_watch = await _wake_on_request(env, tl, narrator)
        stop_watching.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        _check_kubelet(tl, wor_watch, set(), why_ready=", asleep routable too (kept in serving)")
        _report(narrator, timeline_out, tl)
    except Exception as e:  # said as a failed check, then everything torn down
        tl.check(False, f"{type(e).__name__}: {e}")
        if env is not None:
            print(await env.dump_logs(), file=sys.stderr)
    finally:
        stop_watching.set()
        stop_kubelet.set()
        for t in tasks:
            with contextlib.suppress(Exception):
                await t
        await _teardown(cluster, env, tl)
    if tl.failures:
        print("demo FAILED: " + "; ".join(tl.failures), file=sys.stderr)
        return 1
    tl.step("demo passed: idle -> captured -> load -> woken in place -> verified on a real node, with no request "
            "failed and no container restarted; and a model whose last worker slept routable answered its first "
            "request")
    return 0


def run_demo(timeline_out: Path = Path("dynsnap-demo-timeline.png")) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="dynsnap-demo-"))
    try:
        return asyncio.run(_run(workdir, timeline_out))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
