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
3. a table of every capture and wake with each step's measured duration, the same as a PNG timeline
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
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from dynsnap.controller import timeline as TL
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
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows])


def _steps(record: dict[str, Any] | None) -> str:
    return ", ".join(f"{s['name']} {s['seconds']:.2f}s" for s in (record or {}).get("steps") or [])


def _proof_of_wake(ws: Obj) -> dict[str, Any] | None:
    """The controller's passed verification of this worker's last wake, or of a recall after it (a
    quiesce called off as load came back: the controller proves the worker's return to serving again,
    under the wake id ``recall-<quiesce id>``, and that record replaces the wake's). None until then."""
    st = ws.get("status") or {}
    wake = st.get("lastWake") or {}
    v = (st.get("controller") or {}).get("verification") or {}
    if v.get("ok") is not True or not wake.get("id") or not wake.get("finished"):
        return None
    if v.get("wakeId") == wake["id"]:
        return dict(v)
    recall = str(v.get("wakeId", "")).startswith("recall-") and v.get("started")
    if recall and datetime.fromisoformat(v["started"]) >= datetime.fromisoformat(wake["finished"]):
        return dict(v)
    return None


class Narrator:
    """Prints what dynsnap does, as it shows in WorkerSnapshot status and Events (polled; read-only)."""

    def __init__(self, api: Kube, tl: Timeline) -> None:
        self.api = api
        self.tl = tl
        self.seen: dict[str, dict[str, Any]] = {}
        self.events: set[str] = set()
        # pod -> finished operations, in order: what the table prints, and kind + record (as on the
        # WorkerSnapshot) for the PNG timeline
        self.history: dict[str, list[dict[str, Any]]] = {}

    async def poll(self) -> None:
        snaps = (await self.api.list(R.WORKER_SNAPSHOTS, namespace=TEST_NAMESPACE))["items"]
        for ws in snaps:
            self._ws(ws)
        evs = (await self.api.list(R.EVENTS, namespace=TEST_NAMESPACE))["items"]
        for e in sorted(evs, key=lambda e: e.get("eventTime") or e["metadata"].get("creationTimestamp") or ""):
            uid = e["metadata"]["uid"]
            if uid in self.events or not str(e.get("reportingController", "")).startswith(P.DYNSNAP_GROUP):
                continue
            self.events.add(uid)
            who = str(e.get("reportingController", "")).removeprefix(P.DYNSNAP_GROUP + "/")
            self.tl.step(f"  event  {who:<10} {e.get('type'):<7} {e['reason']:<18} "
                         f"{(e.get('regarding') or {}).get('name')}: {e.get('note', '')[:150]}")

    def _ws(self, ws: Obj) -> None:
        name = ws["metadata"]["name"]
        st = ws.get("status") or {}
        rec = st.get("controller") or {}
        last = self.seen.setdefault(name, {})
        hist = self.history.setdefault(name, [])
        q = rec.get("quiesce") or {}
        if q.get("finished") and q.get("ok") and last.get("quiesce") != q.get("id"):
            last["quiesce"] = q.get("id")
            hist.append({"op": "quiesce", "steps": q.get("steps") or [], "kind": "quiesce", "record": q})
            self.tl.step(f"{name}: quiesced by the controller: {_steps(q)}")
        cap = st.get("lastCapture") or {}
        if cap.get("finished") and last.get("capture") != cap.get("id"):
            last["capture"] = cap.get("id")
            hist.append({"op": f"capture ({cap.get('tier')})", "steps": cap.get("steps") or [], "ok": cap.get("ok"),
                         "kind": "capture", "record": cap})
            freed = st.get("image") or {}
            self.tl.step(f"{name}: captured by the agent ({cap.get('tier')}, ok={cap.get('ok')}): {_steps(cap)}"
                         + (f"; image {freed.get('bytes', 0) / 2**20:.0f} MiB" if freed else ""))
        wake = st.get("lastWake") or {}
        if wake.get("finished") and last.get("wake") != wake.get("id"):
            last["wake"] = wake.get("id")
            hist.append({"op": f"wake ({wake.get('tier')})", "steps": wake.get("steps") or [], "ok": wake.get("ok"),
                         "kind": "wake", "record": wake})
            self.tl.step(f"{name}: woken in place by the agent (ok={wake.get('ok')}): {_steps(wake)}")
        v = rec.get("verification") or {}
        if v.get("finished") and last.get("verified") != (v.get("wakeId"), v.get("ok")):
            last["verified"] = (v.get("wakeId"), v.get("ok"))
            hist.append({"op": "verify", "steps": v.get("steps") or [], "ok": v.get("ok"), "kind": "verify",
                         "record": v})
            self.tl.step(f"{name}: verification {'PASSED' if v.get('ok') else 'FAILED'} ({v.get('reason')}): "
                         f"{v.get('answered')}/{v.get('requests')} pinned answers; {_steps(v)}")

    async def run(self, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set() and n < 100_000:
            n += 1
            with contextlib.suppress(Exception):
                await self.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)


class LoadGen:
    """Unpinned chat completions through the frontend from ``clients`` concurrent clients."""

    def __init__(self, fe: D.FrontendClient, clients: int, *, pause: float = 0.0, max_tokens: int = 40) -> None:
        self.fe, self.clients, self.pause, self.max_tokens = fe, clients, pause, max_tokens
        self.ok = 0
        self.failed: list[str] = []
        self.stop_ev = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]

    async def _client(self, i: int) -> None:
        n = 0
        while not self.stop_ev.is_set() and n < 10_000:
            n += 1
            try:
                r = await self.fe.chat(f"load {i}.{n}", max_tokens=self.max_tokens)
                if r.status == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"HTTP {r.status}")
            except httpx.HTTPError as e:
                self.failed.append(f"{type(e).__name__}")
            if self.pause:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop_ev.wait(), self.pause)

    async def stop(self) -> None:
        self.stop_ev.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _snapshots(api: Kube) -> list[Obj]:
    items: list[Obj] = (await api.list(R.WORKER_SNAPSHOTS, namespace=TEST_NAMESPACE))["items"]
    return items


def _asleep(ws: Obj) -> bool:
    return ws["spec"]["desiredState"] == "Suspended" and (ws.get("status") or {}).get("state") == "Suspended"


def _write_timeline(narrator: Narrator, path: Path, tl: Timeline) -> None:
    """The PNG of every operation the narrator saw (dynsnap/controller/timeline.py); a failure to draw
    it is a failed check, said with its reason (the plots extra missing: how to install it)."""
    ops = [op for name in sorted(narrator.history) for h in narrator.history[name]
           if (op := TL.operation(name, h["kind"], h["record"])) is not None]
    try:
        w, h = TL.write_timeline(ops, path, title="dynsnap demo: every quiesce, capture, wake and verification")
    except (TL.PlotsUnavailable, ValueError, OSError) as e:
        tl.check(False, f"timeline PNG not written: {e}")
        return
    tl.check(path.is_file(), f"timeline of {len(ops)} operations drawn: {path.resolve()} ({w}x{h} px)")


async def _run(workdir: Path, timeline_out: Path) -> int:
    tl = Timeline()
    # Its own bridge and /16, so a demo can run beside a test session's cluster (dsnbr0, 10.213/16).
    cluster = LocalCluster(workdir / "cluster", net=SandboxNetwork(bridge=DEMO_BRIDGE, cidr=DEMO_CIDR))
    tl.step("starting etcd, kube-apiserver, kube-controller-manager, kwok, sandbox network")
    await cluster.start()
    agents: list[DS.AgentProc] = []
    controller: DS.ControllerProc | None = None
    stop_narrator = asyncio.Event()
    narrator_task: asyncio.Task[None] | None = None
    try:
        assert cluster.cp is not None
        tl.step(f"control plane up at {cluster.cp.url}; logs in {cluster.cp.logs_dir}")
        driver = DS.build_stub_driver(workdir / "stubcuda")
        await DS.install_dynsnap(cluster)
        agent_cfg = await DS.token_kubeconfig(cluster, namespace=DS.AGENT_NS, sa=DS.AGENT_SA,
                                              path=workdir / "agent.kubeconfig")
        ctl_cfg = await DS.token_kubeconfig(cluster, namespace=DS.AGENT_NS, sa=DS.CONTROLLER_SA,
                                            path=workdir / "controller.kubeconfig")
        tl.step("installed CRD workersnapshots.dynsnap.io and the shipped RBAC (deploy/rbac/); the agents' and "
                "the controller's tokens come from the TokenRequest API")
        for node in NODES:
            a = DS.AgentProc(node, agent_cfg, workdir / f"agent-{node}", driver)
            await a.start()
            agents.append(a)
        controller = DS.ControllerProc(ctl_cfg, workdir / "controller",
                                       extra=["--trace-file", str(workdir / "controller" / "traces.jsonl")])
        await controller.start()
        tl.step(f"node agents on {', '.join(NODES)} and the controller running, each its own process "
                f"(logs in {workdir})")
        worker = D.mocker_component("worker", replicas=WORKERS, dynsnap=True, speedup_ratio=1,
                                    env={"LD_PRELOAD": str(driver.libcuda)})
        body = D.dgd("demo", [D.frontend_component(), worker])
        body["metadata"]["annotations"] = {f"{P.ANNOTATION_PREFIX}{k}": v for k, v in POLICY.items()}
        tl.step("applying DGD demo: frontend + 3 mocker workers under dynsnap-entrypoint, annotated "
                + ", ".join(f"{k}={v}" for k, v in POLICY.items()))
        graph = await D.deploy(cluster, body, wait=False)
        pods = [p for ps in graph.pods.values() for p in ps]
        await asyncio.gather(*(cluster.wait_ready(p.namespace, p.name, timeout=120) for p in pods))
        tl.step("all pods Ready (the controller set each worker's serving gate): "
                + ", ".join(f"{p.name}@{p.ip}" for p in pods))
        narrator = Narrator(cluster.api, tl)
        narrator_task = asyncio.create_task(narrator.run(stop_narrator))
        fe = D.FrontendClient(graph.frontend)
        workers = graph.workers("worker")
        before = {p.name: await cluster.api.get(R.PODS, p.name, namespace=p.namespace) for p in workers}
        trickle = LoadGen(fe, 1, pause=3.0, max_tokens=2)
        burst = LoadGen(fe, 6, max_tokens=60)
        try:
            await fe.wait_model()
            tl.step("phase 1: a trickle of requests (one every 3 s); idle workers are captured down to min-active")
            trickle.start()

            async def down_to_one() -> bool:
                return sum(_asleep(w) for w in await _snapshots(cluster.api)) == WORKERS - 1
            await wait_for("workers captured down to min-active", down_to_one, timeout=180, interval=0.5)
            sleeping = [w["metadata"]["name"] for w in await _snapshots(cluster.api) if _asleep(w)]
            tl.step(f"{len(sleeping)} workers asleep ({', '.join(sleeping)}); one serves the trickle")
            tl.step("phase 2: load arrives (6 concurrent clients through the frontend)")
            burst.start()

            proofs: dict[str, dict[str, Any]] = {}

            async def all_verified() -> bool:
                for w in await _snapshots(cluster.api):
                    name = w["metadata"]["name"]
                    if name in sleeping and name not in proofs and (v := _proof_of_wake(w)) is not None:
                        proofs[name] = v
                return len(proofs) == len(sleeping)
            await wait_for("every sleeper woken and verified", all_verified, timeout=180, interval=0.5)
            await asyncio.sleep(1.0)  # a last round of answers from all three before the load stops
        finally:
            await burst.stop()
            await trickle.stop()
            await narrator.poll()
            stop_narrator.set()
            await fe.close()
        snaps = {w["metadata"]["name"]: w for w in await _snapshots(cluster.api)}
        for name in sleeping:
            v = proofs[name]
            of = "" if v["wakeId"] == snaps[name]["status"]["lastWake"]["id"] else f" (by its {v['wakeId']})"
            tl.check(v["ok"] is True and v["answered"] == v["requests"] == 3,
                     f"{name}: wake verified{of}, {v['answered']}/{v['requests']} requests pinned with "
                     f"{', '.join(v['headers'])} answered by instance {v['workerId']}")
            after = await cluster.api.get(R.PODS, name, namespace=TEST_NAMESPACE)
            ident = snaps[name]["status"]["controller"]["identity"]
            dwm = await cluster.api.get(R.DWMS, name, namespace=TEST_NAMESPACE)
            tl.check(after["metadata"]["uid"] == before[name]["metadata"]["uid"] == ident["podUID"]
                     and after["status"]["podIP"] == ident["podIP"] and dwm["metadata"]["uid"] == ident["dwmUID"],
                     f"{name}: same pod UID, pod IP and DWM UID as before it slept")
        tl.check(not burst.failed and not trickle.failed,
                 f"every request through the frontend answered: {burst.ok + trickle.ok} ok, "
                 f"{len(burst.failed) + len(trickle.failed)} failed")
        tl.check(all(p.kubelet.restarts == 0 for p in workers), "no liveness restart while workers slept")
        rows = []
        for name in sorted(narrator.history):
            for op in narrator.history[name]:
                total = sum(s["seconds"] for s in op["steps"])
                rows.append([name, op["op"], f"{total:.2f}s", _steps(op)])
        print("\nTimeline of every capture and wake (durations measured by the controller and the agents)\n"
              + _table(rows, ["WORKER", "OPERATION", "TOTAL", "STEPS"]) + "\n", flush=True)
        _write_timeline(narrator, timeline_out, tl)
    finally:
        stop_narrator.set()
        if narrator_task is not None:
            with contextlib.suppress(Exception):
                await narrator_task
        tl.step("tearing down")
        if controller is not None:
            await controller.stop()
        await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)
        await cluster.stop()
    if tl.failures:
        print("demo FAILED: " + "; ".join(tl.failures), file=sys.stderr)
        return 1
    tl.step("demo passed: idle -> captured -> load -> woken in place -> verified, with no request failed")
    return 0


def run_demo(timeline_out: Path = Path("dynsnap-demo-timeline.png")) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="dynsnap-demo-"))
    try:
        return asyncio.run(_run(workdir, timeline_out))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
