"""bench/scale: the controller against a fleet of kwok worker pods (8 per kwok node), measured.

    sudo -E $V/bin/python bench/scale/run.py --sizes 1000,10000 --runs 3 --out bench/scale/results/NAME

Needs root (the bench's bridge and the frontend addresses on it) and ``DYNSNAP_TEST_BRIDGE`` /
``DYNSNAP_TEST_CIDR`` (a /16 of its own). Per size it starts a local cluster (etcd, kube-apiserver,
kube-controller-manager, kwok: ``dynsnap.testenv.cluster.LocalCluster``), installs dynsnap's CRD
and RBAC, builds the fleet (``fleet.py``: kwok nodes, DGDs, the operator's Services and pods, the
workers' DWMs), starts the stand-ins in this process (``fake_kubelet``, ``fake_agent`` under the
agent's service account, ``stub_frontend`` on the frontend pod IPs) and waits until the controller
has brought every worker to serving. Then, ``--runs`` times, each with a controller process of its
own (``python -m dynsnap controller`` as shipped, under its RBAC, default settings, its health port
``/metrics`` read for ``dynsnap_api_requests_total``, ``dynsnap_reconciles_total``, the queue depth):

1. start: time until its informers are synced and until its first pass over every worker is done;
2. idle: ``--churn`` of the workers (a random sample, never more than all but 2 of a component) go
   quiet one after another over ``--window`` seconds (the fake agent writes ``status.idle`` with
   ``idleSince`` = that moment); for each, time from the idle threshold (``idleSince`` +
   ``idle-after``) to the controller's decision (``status.controller.quiesce.started``, written in
   the reconcile that decides); wait until all are asleep (quiesce, capture by the fake agent);
3. quiet: ``--quiet`` seconds in which nothing changes: the controller's API requests by verb
   (its ``dynsnap_api_requests_total``), CPU seconds, RSS;
4. demand: the frontends of the graphs with sleeping workers report in-flight requests enough for
   every worker, one graph after another over ``--demand-window`` seconds; for each sleeping worker,
   time from the demand change to the wake request (``status.controller.wake.started``, recorded
   right before ``spec.desiredState=Active`` is patched) and to the fake agent seeing that patch;
   wait until every woken worker is verified (pinned requests answered by the stub frontend) and
   serving again, then the demand drops back to 0.

Each run's numbers go to ``OUT/size-N/run-R.json``; ``summary.py`` makes the table and the plot.
``--profile`` attaches py-spy (``DYNSNAP_BENCH_PYSPY``, default ``py-spy`` on PATH) to the controller
during the first run's start and idle phases and writes the collapsed stacks and a top-functions
table. Everything the bench creates lives in that cluster and on that bridge and goes with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from fake_agent import FakeAgent
from fake_kubelet import FakeKubelet
from fleet import NAMESPACE, Graph, Shape, dgd, fake_dwm, instance_id, nodes, stub_operator_objects
from prometheus_client.parser import text_string_to_metric_families
from stub_frontend import StubFrontends, add_addresses, del_addresses

from dynsnap.controller import fleet as F
from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Conflict
from dynsnap.k8s.informer import Informer
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.policy import parse_duration
from dynsnap.models.workersnapshot import WorkerSnapshot
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.controlplane import free_port
from dynsnap.testenv.dynsnap_parts import AGENT_NS, AGENT_SA, CONTROLLER_SA, install_dynsnap, token_kubeconfig
from dynsnap.testenv.netns import SandboxNetwork
from dynsnap.testenv.process import Supervised

log = logging.getLogger("bench")
HERE = Path(__file__).resolve().parent
TICKS = os.sysconf("SC_CLK_TCK")


def now_utc() -> datetime:
    return datetime.now(UTC)


async def gather_bounded(n: int, coros: list[Any]) -> list[Any]:
    sem = asyncio.Semaphore(n)

    async def one(c: Any) -> Any:
        async with sem:
            return await c
    return await asyncio.gather(*(one(c) for c in coros))


# -- the controller process -----------------------------------------------------------------------

@dataclass
class ControllerRun:
    kubeconfig: Path
    workdir: Path
    name: str
    extra: list[str] = field(default_factory=list)  # more controller flags (--controller-args)
    proc: Supervised | None = None
    port: int = 0
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=30.0, trust_env=False))

    async def start(self) -> None:
        """``dynsnap controller`` as shipped (default settings), its health port on loopback."""
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DYNSNAP_CONTROLLER_")}
        argv = [sys.executable, "-m", "dynsnap", "controller", "--kubeconfig", str(self.kubeconfig),
                "--health-port", str(self.port), "--health-host", "127.0.0.1", "--lease-namespace", AGENT_NS,
                "--identity", self.name, *self.extra]
        self.proc = Supervised(self.name, argv, log_path=self.workdir / f"{self.name}.log", env=env,
                               cwd=HERE.parents[1])
        await self.proc.start()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def ready(self) -> bool:
        r = await self.http.get(f"http://127.0.0.1:{self.port}/readyz")
        return r.status_code == 200

    async def metrics(self) -> dict[str, float]:
        """Every sample of the controller's /metrics as ``name{labels}`` -> value."""
        r = await self.http.get(f"http://127.0.0.1:{self.port}/metrics")
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                lab = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{lab}}}" if lab else s.name] = float(s.value)
        return out

    def proc_stats(self) -> dict[str, float]:
        """CPU seconds (user + system), RSS and peak RSS of the controller process, from /proc."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICKS
        mem = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                mem[k] = int(v.split()[0]) * 1024
        # The event loop's thread (the main one): nanoseconds it ran, and waited runnable for a CPU
        # (the machine is shared: a controller that waits for a core is slow for no fault of its own).
        run_ns, wait_ns, _ = (int(x) for x in Path(f"/proc/{self.pid}/schedstat").read_text().split()[:3])
        return {"cpu_s": cpu, "rss_bytes": mem.get("VmRSS", 0), "hwm_bytes": mem.get("VmHWM", 0),
                "loop_run_s": run_ns / 1e9, "loop_wait_s": wait_ns / 1e9, "t": time.monotonic()}

    async def stop(self) -> None:
        if self.proc is not None:
            await self.proc.stop(grace=20.0)
            self.proc = None

    async def close(self) -> None:
        await self.stop()
        await self.http.aclose()


def delta(a: dict[str, float], b: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0.0) for k in b if k.startswith(prefix) and b[k] - a.get(k, 0.0) != 0}


def reconciles(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("dynsnap_reconciles_total{controller=controller,"))


def verbs(d: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        if k.startswith("dynsnap_api_requests_total{"):
            verb = k.split("verb=", 1)[1].rstrip("}")
            out[verb] = out.get(verb, 0.0) + v
    return out


# -- py-spy ---------------------------------------------------------------------------------------

class PySpy:
    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, seconds: int) -> bool:
        exe = os.environ.get("DYNSNAP_BENCH_PYSPY") or shutil.which("py-spy")
        if not exe:
            log.warning("py-spy not found (DYNSNAP_BENCH_PYSPY): no profile")
            return False
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(self.pid), "--rate", "50", "--duration", str(seconds),
             "--format", "raw", "--output", str(self.out), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return True

    async def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        for _ in range(300):
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        else:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def top_functions(raw: Path, n: int = 30) -> str:
    """Self and inclusive sample shares by function from py-spy's collapsed stacks."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        own[frames[-1]] += c
        for f in set(frames):
            incl[f] += c
    if not total:
        return "(no samples)\n"
    lines = [f"{total} samples\n", "## self (leaf frame)"]
    lines += [f"{100 * v / total:6.2f}%  {k}" for k, v in own.most_common(n)]
    lines += ["", "## inclusive (frame anywhere on the stack)"]
    lines += [f"{100 * v / total:6.2f}%  {k}" for k, v in incl.most_common(n)]
    return "\n".join(lines) + "\n"


# -- the bench ------------------------------------------------------------------------------------

@dataclass
class Bench:
    shape: Shape
    out: Path  # results (committed)
    logs: Path  # the controller's and the cluster's logs (not committed: large)
    args: argparse.Namespace
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dsn-scale-")))
    cluster: LocalCluster | None = None
    agent_kube: Kube | None = None
    pods: Informer | None = None
    kubelet: FakeKubelet | None = None
    agent: FakeAgent | None = None
    frontends: StubFrontends | None = None
    graphs: list[Graph] = field(default_factory=list)
    iid_pod: dict[int, str] = field(default_factory=dict)  # instance id -> pod key
    worker_keys: list[str] = field(default_factory=list)
    comp_of: dict[str, str] = field(default_factory=dict)  # pod key -> "graph/component"
    graph_of: dict[str, str] = field(default_factory=dict)  # pod key -> graph
    fe_ips: list[str] = field(default_factory=list)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    ctl_cfg: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)
    ctl: ControllerRun | None = None  # the controller of the run under way
    _parsed: dict[str, tuple[str, WorkerSnapshot | None]] = field(default_factory=dict)

    @property
    def api(self) -> Kube:
        assert self.cluster is not None
        return self.cluster.api

    @property
    def bridge(self) -> str:
        assert self.cluster is not None
        return self.cluster.net.bridge

    # -- setup ------------------------------------------------------------------------------------

    async def setup(self) -> None:
        t0 = time.monotonic()
        net = SandboxNetwork(bridge=os.environ["DYNSNAP_TEST_BRIDGE"], cidr=os.environ["DYNSNAP_TEST_CIDR"])
        self.cluster = LocalCluster(self.work / "cluster", net=net)
        await self.cluster.start()
        await install_dynsnap(self.cluster)
        agent_cfg = await token_kubeconfig(self.cluster, namespace=AGENT_NS, sa=AGENT_SA,
                                           path=self.work / "agent.kubeconfig")
        self.ctl_cfg = await token_kubeconfig(self.cluster, namespace=AGENT_NS, sa=CONTROLLER_SA,
                                              path=self.work / "ctl.kubeconfig")
        with contextlib.suppress(Conflict):
            await self.api.create(R.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": NAMESPACE}})
        await wait_for(f"serviceaccount {NAMESPACE}/default",
                       lambda: self.api.get(R.SERVICE_ACCOUNTS, "default", namespace=NAMESPACE), timeout=60)
        all_nodes = nodes(self.shape, os.environ["DYNSNAP_TEST_CIDR"])
        await gather_bounded(32, [self.api.create(R.NODES, n) for n in all_nodes])
        names = {n["metadata"]["name"] for n in all_nodes}

        async def nodes_ready() -> bool:
            listed = await self.api.list(R.NODES, label_selector="type=kwok")
            ready = {n["metadata"]["name"] for n in listed.get("items", [])
                     if any(c["type"] == "Ready" and c["status"] == "True"
                            for c in (n.get("status") or {}).get("conditions") or [])}
            return names <= ready
        await wait_for(f"{len(names)} kwok nodes Ready", nodes_ready, timeout=600, interval=2.0)
        self.timings["nodes_s"] = time.monotonic() - t0

        self.pods = Informer(self.api, R.PODS, namespace=NAMESPACE, label_selector=P.LABEL_DGD_NAME, name="pods")
        self.kubelet = FakeKubelet(self.api, self.pods)
        self.tasks.append(self.pods.start())
        await self.pods.wait_synced(120)
        self.tasks.append(asyncio.create_task(self.kubelet.run(), name="fake-kubelet"))

        created = await gather_bounded(16, [self.api.create(R.DGDS, dgd(self.shape, i))
                                            for i in range(self.shape.graphs)])
        pod_bodies: list[Obj] = []
        svc_bodies: list[Obj] = []
        for i, d in enumerate(created):
            svcs, pods, g = stub_operator_objects(self.shape, d, i)
            svc_bodies += svcs
            pod_bodies += pods
            self.graphs.append(g)
            for comp, names_ in g.workers.items():
                for name in names_:
                    key = f"{NAMESPACE}/{name}"
                    self.worker_keys.append(key)
                    self.comp_of[key] = f"{g.name}/{comp}"
                    self.graph_of[key] = g.name
        await gather_bounded(32, [self.api.create(R.SERVICES, s) for s in svc_bodies])
        made = await gather_bounded(32, [self.api.create(R.PODS, p) for p in pod_bodies])
        uid = {p["metadata"]["name"]: p for p in made}
        self.timings["objects_s"] = time.monotonic() - t0

        def running() -> bool:
            assert self.pods is not None
            return sum(1 for p in self.pods.store.list() if (p.get("status") or {}).get("podIP")) >= len(made)
        await self._until(f"{len(made)} pods Running with an IP (kwok)", running, timeout=1800)
        self.timings["pods_running_s"] = time.monotonic() - t0

        dwms = []
        for gi, g in enumerate(self.graphs):
            slot = 0
            for comp in ("prefill", "decode"):
                for name in g.workers[comp]:
                    iid = instance_id(gi, slot)
                    slot += 1
                    self.iid_pod[iid] = f"{NAMESPACE}/{name}"
                    dwms.append(fake_dwm(uid[name], iid))
        await gather_bounded(32, [self.api.create(R.DWMS, d) for d in dwms])

        assert self.pods is not None
        for g in self.graphs:
            pod = self.pods.store.get(NAMESPACE, g.frontend)
            assert pod is not None
            g.frontend_ip = pod["status"]["podIP"]
        self.fe_ips = [g.frontend_ip for g in self.graphs]
        await add_addresses(self.bridge, self.fe_ips)
        self.frontends = StubFrontends(routable=self._routable)
        for g in self.graphs:
            await self.frontends.serve(g.frontend_ip, g.name)

        self.agent_kube = await Kube.from_kubeconfig(agent_cfg, field_manager=P.AGENT_FIELD_MANAGER)
        self.agent = FakeAgent(self.agent_kube, namespace=NAMESPACE)
        self.tasks.append(self.agent.informer.start())
        await self.agent.informer.wait_synced(120)
        self.tasks.append(asyncio.create_task(self.agent.run(), name="fake-agent"))
        self.timings["fleet_s"] = time.monotonic() - t0
        log.info("fleet up: %d graphs, %d workers, %d nodes in %.0fs", len(self.graphs), len(self.worker_keys),
                 len(all_nodes), self.timings["fleet_s"])

    def _routable(self, iid: int) -> bool:
        key = self.iid_pod.get(iid)
        if key is None or self.pods is None:
            return False
        pod = self.pods.store.get_key(key)
        return pod is not None and F.pod_ready(pod)

    async def _until(self, what: str, check: Any, *, timeout: float, interval: float = 1.0) -> None:
        async def probe() -> bool:
            return bool(check())
        await wait_for(what, probe, timeout=timeout, interval=interval)

    # -- reading the fleet ------------------------------------------------------------------------

    def ws(self, key: str) -> WorkerSnapshot | None:
        """The WorkerSnapshot as the fake agent's informer has it, parsed once per resourceVersion (the
        bench looks at every worker every second: parsing each time would take the controller's CPU)."""
        assert self.agent is not None
        obj = self.agent.informer.store.get_key(key)
        if obj is None:
            return None
        rv = str(obj["metadata"].get("resourceVersion"))
        hit = self._parsed.get(key)
        if hit is None or hit[0] != rv:
            hit = (rv, F.parse_ws(obj))
            self._parsed[key] = hit
        return hit[1]

    def serving(self, key: str) -> bool:
        assert self.pods is not None
        ws, pod = self.ws(key), self.pods.store.get_key(key)
        if ws is None or pod is None:
            return False
        return (ws.spec.desired_state == P.DesiredState.ACTIVE and ws.status.state == P.ObservedState.ACTIVE
                and F.pod_ready(pod) and F.pod_condition(pod, P.CONDITION_SERVING) == "True"
                and not F.verification_pending(ws) and not F.verification_failed(ws))

    def asleep(self, key: str) -> bool:
        ws = self.ws(key)
        if ws is None:
            return False
        c = ws.condition(P.ConditionType.SUSPENDED)
        return (ws.spec.desired_state == P.DesiredState.SUSPENDED and ws.status.state == P.ObservedState.SUSPENDED
                and c is not None and c.status == "True")

    def count(self, keys: list[str], pred: Any) -> int:
        return sum(1 for k in keys if pred(k))

    async def wait_keys(self, what: str, keys: list[str], pred: Any, *, timeout: float) -> float:
        t0 = time.monotonic()
        deadline = t0 + timeout
        last = -1
        while time.monotonic() < deadline:
            proc = self.ctl.proc if self.ctl is not None else None
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{what}: the controller exited ({proc.proc and proc.proc.returncode}): "
                                   f"{proc.tail(3)}")
            n = self.count(keys, pred)
            if n == len(keys):
                return time.monotonic() - t0
            if n != last:
                log.info("%s: %d/%d", what, n, len(keys))
                last = n
            await asyncio.sleep(1.0)
        bad = [k for k in keys if not pred(k)][:5]
        raise TimeoutError(f"{what}: {self.count(keys, pred)}/{len(keys)} after {timeout:.0f}s; e.g. "
                           + "; ".join(f"{k}: {self._describe(k)}" for k in bad))

    def _describe(self, key: str) -> str:
        ws = self.ws(key)
        assert self.pods is not None
        pod = self.pods.store.get_key(key) or {}
        if ws is None:
            return "no WorkerSnapshot"
        rec = ws.status.controller
        return (f"desired={ws.spec.desired_state.value} state={ws.status.state} "
                f"ready={F.pod_ready(pod)} gate={F.pod_condition(pod, P.CONDITION_SERVING)} "
                f"decision={rec.decision if rec else None!r}")

    async def quiet_controller(self, ctl: ControllerRun, *, timeout: float, still: float = 3.0) -> float:
        """Wait until the controller's queue is empty and no reconcile ran for ``still`` seconds."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        last, since = -1.0, time.monotonic()
        while time.monotonic() < deadline:
            m = await ctl.metrics()
            n = reconciles(m)
            if n != last or m.get("dynsnap_queue_depth{controller=controller}", 0.0) > 0:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= still:
                return since - t0
            await asyncio.sleep(0.5)
        raise TimeoutError(f"controller still reconciling after {timeout:.0f}s")

    # -- one run ----------------------------------------------------------------------------------

    async def converge(self) -> None:
        """The first controller brings every new worker to serving (WorkerSnapshot, agent, gate)."""
        assert self.ctl_cfg is not None
        t0 = time.monotonic()
        restarts = 0
        while True:
            ctl = ControllerRun(self.ctl_cfg, self.logs, f"controller-setup{restarts or ''}",
                                extra=self.args.controller_args.split())
            self.ctl = ctl
            await ctl.start()
            try:
                await self.wait_keys("workers serving", self.worker_keys, self.serving,
                                     timeout=self.args.converge_timeout - (time.monotonic() - t0))
                self.timings["converge_s"] = time.monotonic() - t0
                await self.quiet_controller(ctl, timeout=600)
                break
            except RuntimeError as e:  # it exited: restarted, as its Deployment would
                if ctl.proc is None or ctl.proc.alive() or restarts >= 10:
                    raise
                restarts += 1
                log.warning("converge: the controller exited (%s); restart %d", e, restarts)
            finally:
                await ctl.close()
                self.ctl = None
        self.timings["converge_restarts"] = restarts

    async def run_once(self, r: int, res: dict[str, Any]) -> None:
        """One run; what it measured is in ``res`` as soon as it is measured (a failed run keeps it)."""
        assert self.ctl_cfg is not None and self.agent is not None and self.frontends is not None
        rng = random.Random(1000 * r + self.shape.workers)
        idle_after = parse_duration(self.shape.idle_after)
        res.update({"size": self.shape.workers, "run": r, "graphs": len(self.graphs), "idle_after_s": idle_after,
                    "churn": self.args.churn, "window_s": self.args.window, "started": now_utc().isoformat(),
                    "loadavg_start": list(os.getloadavg()), "controller_args": self.args.controller_args})
        for g in self.graphs:
            self.frontends.set_demand(g.name, 0.0)
        ctl = ControllerRun(self.ctl_cfg, self.logs, f"controller-run{r}", extra=self.args.controller_args.split())
        self.ctl = ctl
        spy: PySpy | None = None
        profile = self.args.profile and r == 1
        await ctl.start()
        try:
            t0 = time.monotonic()
            if profile:
                spy = PySpy(ctl.pid, self.out / f"pyspy-start-run{r}.txt")
                spy.start(600)
            assert ctl.proc is not None
            await ctl.proc.wait_ready(ctl.ready, timeout=600, what="synced")
            res["start_synced_s"] = time.monotonic() - t0
            t_pass = time.monotonic()
            last_change = await self.quiet_controller(ctl, timeout=1800)
            res["start_first_pass_s"] = t_pass - t0 + last_change
            res["settle_wait_s"] = await self.wait_keys("settled (serving or asleep)", self.worker_keys,
                                                        lambda k: self.serving(k) or self.asleep(k), timeout=900)
            if spy is not None:
                await spy.stop()
                self._write_profile(self.out / f"pyspy-start-run{r}.txt")
            s_start = ctl.proc_stats()
            res["start_cpu_s"] = s_start["cpu_s"]
            res["start_rss_bytes"] = s_start["rss_bytes"]

            # -- idle: the churn goes quiet one after another over the window -----------------------
            by_comp: dict[str, list[str]] = {}
            for k in self.worker_keys:
                if self.serving(k):
                    by_comp.setdefault(self.comp_of[k], []).append(k)
            pool = [k for ks in by_comp.values() for k in ks]
            rng.shuffle(pool)
            want = max(1, round(self.args.churn * len(self.worker_keys)))
            taken: Counter[str] = Counter()
            chosen: list[str] = []
            for k in pool:
                c = self.comp_of[k]
                if taken[c] < len(by_comp[c]) - 2:  # the component keeps 2 serving (min-active 1 + 1)
                    taken[c] += 1
                    chosen.append(k)
                if len(chosen) == want:
                    break
            res["chosen"] = len(chosen)
            m0, s0 = await ctl.metrics(), ctl.proc_stats()
            if profile:
                spy = PySpy(ctl.pid, self.out / f"pyspy-idle-run{r}.txt")
                spy.start(int(self.args.window + idle_after + 600))
            idle_since: dict[str, datetime] = {}
            t_idle = time.monotonic()
            for i, k in enumerate(chosen):
                at = t_idle + i * self.args.window / len(chosen)
                if (d := at - time.monotonic()) > 0:
                    await asyncio.sleep(d)
                since = now_utc()
                idle_since[k] = since
                self.agent.go_idle(k, since)
            res["asleep_wait_s"] = await self.wait_keys("asleep", chosen, self.asleep,
                                                        timeout=self.args.window + idle_after + 1800)
            m1, s1 = await ctl.metrics(), ctl.proc_stats()
            if spy is not None:
                await spy.stop()
                self._write_profile(self.out / f"pyspy-idle-run{r}.txt")
            lat = []
            for k in chosen:
                ws = self.ws(k)
                q = ws.status.controller.quiesce if ws and ws.status.controller else None
                if q is None:
                    continue
                if q.started < idle_since[k]:
                    continue  # an earlier run's quiesce: this one's decision is not on record
                threshold = idle_since[k].timestamp() + idle_after
                lat.append(q.started.timestamp() - threshold)
            res["decisions"] = len(lat)
            res["decision_latency_s"] = sorted(lat)
            res["idle_phase"] = {"seconds": s1["t"] - s0["t"], "cpu_s": s1["cpu_s"] - s0["cpu_s"],
                                 "loop_run_s": s1["loop_run_s"] - s0["loop_run_s"],
                                 "loop_wait_for_cpu_s": s1["loop_wait_s"] - s0["loop_wait_s"],
                                 "api_requests": verbs(delta(m0, m1, "dynsnap_api_requests_total")),
                                 "reconciles": reconciles(m1) - reconciles(m0),
                                 "hwm_bytes": s1["hwm_bytes"]}

            # -- quiet: nothing changes --------------------------------------------------------------
            await self.quiet_controller(ctl, timeout=900)
            q0, qs0 = await ctl.metrics(), ctl.proc_stats()
            await asyncio.sleep(self.args.quiet)
            q1, qs1 = await ctl.metrics(), ctl.proc_stats()
            secs = qs1["t"] - qs0["t"]
            res["quiet"] = {"seconds": secs, "cpu_s_per_min": 60 * (qs1["cpu_s"] - qs0["cpu_s"]) / secs,
                            "api_rps": {v: n / secs for v, n in verbs(delta(q0, q1, "dynsnap_api_requests_total"))
                                        .items()},
                            "reconciles": reconciles(q1) - reconciles(q0),
                            "frontend_scrapes": sum(delta(q0, q1, "dynsnap_frontend_scrapes_total").values()),
                            "rss_bytes": qs1["rss_bytes"], "hwm_bytes": qs1["hwm_bytes"]}

            # -- demand: load returns at the frontends of the graphs with sleepers ------------------
            graphs = sorted({self.graph_of[k] for k in chosen})
            demand_at: dict[str, float] = {}
            full = float(self.shape.wake_at_inflight * self.shape.per_graph)
            t_dem = time.monotonic()
            d0, ds0 = await ctl.metrics(), ctl.proc_stats()
            for i, g in enumerate(graphs):
                at = t_dem + i * self.args.demand_window / len(graphs)
                if (d := at - time.monotonic()) > 0:
                    await asyncio.sleep(d)
                demand_at[g] = self.frontends.set_demand(g, full)

            def wake_requested(k: str) -> bool:
                ws = self.ws(k)
                return bool(ws and ws.spec.desired_state == P.DesiredState.ACTIVE)
            res["wake_wait_s"] = await self.wait_keys("wake requested", chosen, wake_requested,
                                                      timeout=self.args.demand_window + 900)
            wl, seen = [], []
            for k in chosen:
                ws = self.ws(k)
                w = ws.status.controller.wake if ws and ws.status.controller else None
                if w is not None:
                    wl.append(w.started.timestamp() - demand_at[self.graph_of[k]])
                s = self.agent.seen.get(k)
                if s and s[0] == P.DesiredState.ACTIVE.value:
                    seen.append(s[1] - demand_at[self.graph_of[k]])
            res["wake_latency_s"] = sorted(wl)
            res["wake_seen_by_agent_s"] = sorted(seen)
            res["verified_wait_s"] = await self.wait_keys("woken, verified, serving", chosen, self.serving,
                                                          timeout=1800)
            d1, ds1 = await ctl.metrics(), ctl.proc_stats()
            res["demand_phase"] = {"seconds": ds1["t"] - ds0["t"], "cpu_s": ds1["cpu_s"] - ds0["cpu_s"],
                                   "loop_run_s": ds1["loop_run_s"] - ds0["loop_run_s"],
                                   "loop_wait_for_cpu_s": ds1["loop_wait_s"] - ds0["loop_wait_s"],
                                   "api_requests": verbs(delta(d0, d1, "dynsnap_api_requests_total")),
                                   "reconciles": reconciles(d1) - reconciles(d0),
                                   "hwm_bytes": ds1["hwm_bytes"]}
            for g in graphs:
                self.frontends.set_demand(g, 0.0)
            await self.quiet_controller(ctl, timeout=900)
            end = ctl.proc_stats()
            res["end_rss_bytes"], res["end_hwm_bytes"] = end["rss_bytes"], end["hwm_bytes"]
            res["loadavg"] = list(os.getloadavg())  # the machine is shared: how busy it was
            res["metrics_end"] = {k: v for k, v in (await ctl.metrics()).items()
                                  if k.startswith(("dynsnap_api_requests_total", "dynsnap_reconciles_total",
                                                   "dynsnap_frontend_scrapes_total"))}
        finally:
            if spy is not None:
                await spy.stop()
            res["controller_exit"] = ctl.proc.proc.returncode if ctl.proc and ctl.proc.proc else None
            res["controller_log_tail"] = ctl.proc.tail(8) if ctl.proc and not ctl.proc.alive() else ""
            await ctl.close()
            self.ctl = None

    def _write_profile(self, raw: Path) -> None:
        if raw.exists():
            raw.with_suffix(".top.txt").write_text(top_functions(raw))

    # -- teardown ---------------------------------------------------------------------------------

    async def teardown(self) -> None:
        """Stop the stand-ins, take the frontend addresses off the bridge, keep the cluster's logs, stop
        the cluster (its bridge, kwok nodes and every object go with it); each step even if one failed."""
        async def safely(what: str, aw: Any) -> None:
            try:
                await asyncio.wait_for(aw, 120.0)
            except Exception:
                log.exception("teardown: %s", what)

        if self.agent is not None:
            self.agent.stop()
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.frontends is not None:
            await safely("frontends", self.frontends.close())
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.agent is not None:
            await safely("agent informer", self.agent.informer.stop())
        if self.pods is not None:
            await safely("pods informer", self.pods.stop())
        if self.agent_kube is not None:
            await safely("agent client", self.agent_kube.close())
        if self.cluster is not None:
            if self.fe_ips:
                await safely("frontend addresses", del_addresses(self.bridge, self.fe_ips))
            keep = self.logs / "cluster"
            with contextlib.suppress(Exception):
                for f in (self.work / "cluster").rglob("*.log"):
                    if f.stat().st_size < 50 << 20:
                        dest = keep / f.relative_to(self.work / "cluster")
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(f, dest)
            await safely("cluster", self.cluster.stop())
        shutil.rmtree(self.work, ignore_errors=True)


def code_version() -> str:
    """The commit the measured controller came from, and whether its code differed from it."""
    root = HERE.parents[1]
    if (root / "BEFORE_COMMIT").exists():  # an exported tree (git archive) of that commit
        return (root / "BEFORE_COMMIT").read_text().strip() + " (exported)"
    rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--short", "--", "dynsnap/controller"],
                           capture_output=True, text=True).stdout.split()
    return rev + (f" + uncommitted {' '.join(dirty[1::2])}" if dirty else "")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


async def run_size(bench: Bench, args: argparse.Namespace) -> None:
    shape, out = bench.shape, bench.out
    await bench.setup()
    await bench.converge()
    (out / "setup.json").write_text(json.dumps({"size": shape.workers, "graphs": shape.graphs,
                                                "nodes": shape.nodes, "controller_args": args.controller_args,
                                                "code": code_version(), **bench.timings}, indent=1))
    for r in range(1, args.runs + 1):
        res: dict[str, Any] = {}
        try:
            await bench.run_once(r, res)
        except Exception as e:
            log.exception("size %d run %d failed", shape.workers, r)
            res["error"] = f"{type(e).__name__}: {e}"
        (out / f"run-{r}.json").write_text(json.dumps(res, indent=1))
        if "error" in res:
            continue
        log.info("size %d run %d: decision p50 %.3fs p99 %.3fs; wake p50 %.3fs; quiet %s rss %.0f MiB",
                 shape.workers, r, pct(res["decision_latency_s"], 0.5) or -1,
                 pct(res["decision_latency_s"], 0.99) or -1, pct(res["wake_latency_s"], 0.5) or -1,
                 res["quiet"]["api_rps"], res["quiet"]["rss_bytes"] / 2**20)


async def main_async(args: argparse.Namespace) -> int:
    """Each size in a task of its own; SIGINT/SIGTERM cancel that task, and the teardown runs here,
    outside it, so a cancelled bench still removes everything it made."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    rc = 0
    for size in [int(s) for s in args.sizes.split(",")]:
        out = Path(args.out) / f"size-{size}"
        out.mkdir(parents=True, exist_ok=True)
        logs = Path(args.logs) / f"size-{size}"
        logs.mkdir(parents=True, exist_ok=True)
        bench = Bench(Shape(workers=size, idle_after=args.idle_after), out, logs, args)
        work = asyncio.create_task(run_size(bench, args), name=f"size {size}")
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([work, stopper], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                log.warning("stopping: tearing down")
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        except Exception:
            log.exception("size %d failed", size)
            rc = 1
        finally:
            stopper.cancel()
            await bench.teardown()
        if stop.is_set():
            return 130
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,10000")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--logs", default="/tmp/dsn-scale-logs", help="logs directory (controller, cluster)")
    p.add_argument("--idle-after", default="20s")
    p.add_argument("--churn", type=float, default=0.05, help="share of the workers that go idle in a run")
    p.add_argument("--window", type=float, default=60.0, help="seconds over which they go idle")
    p.add_argument("--demand-window", type=float, default=30.0)
    p.add_argument("--quiet", type=float, default=60.0)
    p.add_argument("--converge-timeout", type=float, default=3600.0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--controller-args", default="", help="more `dynsnap controller` flags (default: none)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("dynsnap.k8s", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not os.environ.get("DYNSNAP_TEST_BRIDGE") or not os.environ.get("DYNSNAP_TEST_CIDR"):
        p.error("set DYNSNAP_TEST_BRIDGE and DYNSNAP_TEST_CIDR (a bridge and a /16 of the bench's own)")
    import resource
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
