"""``dynsnap controller``: the process. Informers on DGDs, their pods, DWMs, discovery EndpointSlices
and WorkerSnapshots; a work queue of worker pods drained by the reconciler; a loop that scrapes
each opted-in graph's frontend for demand and requeues the graph's workers when it changes.

Any change to a worker, its WorkerSnapshot, DWM or endpoint requeues that worker, and every worker
of its component when it changed what the planner sees of the worker (its phase, idle facts, last
capture, override: the plan is per component, so only such a change can change what a peer should
be; the controller's own status writes mostly do not, and fanning each out to the whole component
made most of its reconciles, docs/BENCHMARKS.md); a graph's change requeues all its workers. Nothing
is polled while nothing changes, apart from the frontend scrape (one GET per opted-in graph per
interval) and the Lease renewals.

Layer: ``dynsnap.controller``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from dynsnap.controller import fleet as F
from dynsnap.controller.frontend import Frontend, FrontendError
from dynsnap.controller.plan import Demand, Phase, WorkerView, needed
from dynsnap.controller.reconciler import Hooks, Reconciler, Stores
from dynsnap.controller.settings import ControllerSettings
from dynsnap.k8s.client import Kube
from dynsnap.k8s.events import EventRecorder
from dynsnap.k8s.informer import Informer, strip_managed_fields
from dynsnap.k8s.leases import Leases
from dynsnap.k8s.store import DELETED, MODIFIED, label
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.policy import parse_policy
from dynsnap.runtime.leader import LeaderElector
from dynsnap.runtime.manager import Manager, run_until_stopped
from dynsnap.runtime.workqueue import WorkQueue, run_workers
from dynsnap.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
Obj = dict[str, Any]


def _dgd_index(obj: Obj) -> list[str]:
    key = F.dgd_key(obj)
    return [key] if key else []


def _uid_index(obj: Obj) -> list[str]:
    uid = (obj.get("metadata") or {}).get("uid")
    return [str(uid)] if uid else []


class Controller:
    """The controller's parts, wired; :meth:`runnables` are what the manager runs while leading."""

    def __init__(self, kube: Kube, settings: ControllerSettings, *, identity: str = "",
                 hooks: Hooks | None = None) -> None:
        self.kube = kube
        self.settings = settings
        ns = settings.namespace or None
        # Stores keep every graph, worker pod, DWM, endpoint and WorkerSnapshot of the cluster for
        # the process's life; managedFields were half their bytes and nothing here reads them
        # (bench/scale: the controller's RSS at 10,000 workers, docs/BENCHMARKS.md).
        slim = strip_managed_fields
        self.dgds = Informer(kube, R.DGDS, namespace=ns, name="dgds", transform=slim)
        self.pods = Informer(kube, R.PODS, namespace=ns, label_selector=P.LABEL_DGD_NAME,
                             indexers={"dgd": _dgd_index, "uid": _uid_index}, name="pods", transform=slim)
        self.dwms = Informer(kube, R.DWMS, namespace=ns, name="dwms", transform=slim)
        self.slices = Informer(kube, R.ENDPOINT_SLICES, namespace=ns,
                               label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true",
                               indexers={"target": F.endpoint_targets}, name="endpointslices", transform=slim)
        self.wss = Informer(kube, R.WORKER_SNAPSHOTS, namespace=ns, indexers={"node": label(P.LABEL_NODE)},
                            name="workersnapshots", transform=slim)
        self.informers = [self.dgds, self.pods, self.dwms, self.slices, self.wss]
        self.queue: WorkQueue[str] = WorkQueue(base_delay=0.2, max_delay=60.0, group_of=self._graph_of,
                                               group_limit=settings.workers_per_graph)
        self.frontend = Frontend(timeout=settings.verify_request_timeout)
        self.metrics = Metrics()
        self.metrics.add_refresh(self._refresh_metrics)
        kube.on_request = self.metrics.api_request
        self.events = EventRecorder(kube, reporting_controller=f"{P.DYNSNAP_GROUP}/controller",
                                    reporting_instance=identity or P.CONTROLLER_COMPONENT)
        self.reconciler = Reconciler(kube=kube, settings=settings, frontend=self.frontend, events=self.events,
                                     hooks=hooks or Hooks(), metrics=self.metrics,
                                     stores=Stores(dgds=self.dgds.store, pods=self.pods.store, dwms=self.dwms.store,
                                                   slices=self.slices.store, wss=self.wss.store))
        self._views: dict[str, WorkerView] = {}  # "ns/pod" -> the planner's view of it when last seen
        self._opted_in: dict[str, tuple[str, bool]] = {}  # "ns/dgd" -> (resourceVersion, opted in)
        self.pods.add_handler(self._on_pod)
        self.wss.add_handler(self._on_ws)
        self.dwms.add_handler(self._on_named)
        self.slices.add_handler(self._on_slice)
        self.dgds.add_handler(self._on_dgd)

    def _refresh_metrics(self) -> None:
        """Gauges from the stores, when /metrics is read (nothing is computed while nobody looks)."""
        self.metrics.set_queue_depth("controller", self.queue.depth)
        counts: dict[str, int] = {}
        freed = 0
        for obj in self.wss.store.list():
            st = obj.get("status") or {}
            state = str(st.get("state") or P.ObservedState.UNKNOWN.value)
            counts[state] = counts.get(state, 0) + 1
            if state == P.ObservedState.SUSPENDED.value:
                for g in (st.get("lastCapture") or {}).get("gpus") or []:
                    before, after = g.get("freeBefore"), g.get("freeAfter")
                    if isinstance(before, int) and isinstance(after, int) and after > before:
                        freed += after - before
        self.metrics.set_workers(counts)
        self.metrics.set_gpu_bytes_freed(freed)

    async def reconcile(self, key: str) -> float | None:
        try:
            again = await self.reconciler.reconcile(key)
        except Exception:
            self.metrics.reconciled("controller", "error")
            raise
        self.metrics.reconciled("controller", "requeue" if again is not None else "done")
        return again

    # -- event -> keys ----------------------------------------------------------------------------

    def _enqueue_component(self, pod: Obj) -> None:
        dgd = F.dgd_key(pod)
        if dgd is None:
            return
        comp = F.component_of(pod)
        for p in self.pods.store.by_index("dgd", dgd):
            if F.component_of(p) == comp and F.is_worker_pod(p):
                self.queue.add(f"{p['metadata']['namespace']}/{p['metadata']['name']}")

    def _enqueue_graph(self, dgd: str, *, skip: Phase | None = None) -> None:
        """Every worker of the graph, but those last seen in phase ``skip`` (a demand change that
        cannot alter their decision)."""
        for p in self.pods.store.by_index("dgd", dgd):
            if F.is_worker_pod(p):
                key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
                view = self._views.get(key)
                if skip is None or view is None or view.phase != skip:
                    self.queue.add(key)

    @staticmethod
    def demand_skips(before: Demand | None, after: Demand | None) -> Phase | None:
        """Which workers a demand change need not reconcile. More demand never puts a serving worker
        to sleep, less never wakes a sleeping one; so a rise requeues all but the serving, a fall all
        but the asleep (with 500 graphs of 20 workers a rise requeued 20 workers to wake one, and
        the reconciles queued in front made the wakes wait: bench/scale, docs/BENCHMARKS.md).
        Demand becoming known or unknown requeues everyone."""
        if before is None or after is None or before.total == after.total:
            return None
        return Phase.SERVING if after.total > before.total else Phase.ASLEEP

    def _touched(self, pod: Obj, *, always: bool = False) -> None:
        """A worker's pod, WorkerSnapshot or endpoint changed: reconcile it, and its whole component
        when the planner's view of it changed (or ``always``: it came or went)."""
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        self.queue.add(key)
        view = self.reconciler.view_of(pod)
        if always or self._views.get(key) != view:
            self._views[key] = view
            self._enqueue_component(pod)

    def _on_pod(self, typ: str, pod: Obj) -> None:
        if F.is_worker_pod(pod):
            self._touched(pod, always=typ != MODIFIED)
            if typ == DELETED:
                self._views.pop(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}", None)
        elif (key := F.dgd_key(pod)) is not None:
            self._enqueue_graph(key)  # a frontend came or went: verification and demand depend on it

    def _graph_of(self, key: str) -> str:
        """The work queue's group of a worker's key: its graph (``ns/dgd``, by its pod's label), so that one
        graph's slow reconciles hold at most ``workers_per_graph`` of the workers; a pod not known, its own."""
        ns, name = key.split("/", 1)
        pod = self.pods.store.get(ns, name)
        dgd = ((pod or {}).get("metadata", {}).get("labels") or {}).get(P.LABEL_DGD_NAME)
        return f"{ns}/{dgd}" if dgd else key

    def _on_ws(self, typ: str, ws: Obj) -> None:
        pod = self.pods.store.get(ws["metadata"].get("namespace"), ws["metadata"]["name"])
        if pod is not None:
            self._touched(pod, always=typ != MODIFIED)

    def _on_named(self, typ: str, obj: Obj) -> None:
        pod = self.pods.store.get(obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if pod is not None:
            self.queue.add(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}")

    def _on_slice(self, typ: str, s: Obj) -> None:
        for uid in F.endpoint_targets(s):
            for pod in self.pods.store.by_index("uid", uid):
                if F.is_worker_pod(pod):
                    self._touched(pod, always=typ != MODIFIED)

    def _on_dgd(self, typ: str, dgd: Obj) -> None:
        key = f"{dgd['metadata'].get('namespace')}/{dgd['metadata']['name']}"
        if typ == DELETED:
            self.reconciler.forget_graph(key)  # its model, demand and policy Events go with it
        self._enqueue_graph(key)

    # -- demand -----------------------------------------------------------------------------------

    def opted_in_graphs(self) -> list[Obj]:
        """The graphs with a worker component opted in; each DGD's answer kept for its resourceVersion
        (this runs every scrape interval over every graph)."""
        out = []
        known: dict[str, tuple[str, bool]] = {}
        for dgd in self.dgds.store.list():
            meta = dgd["metadata"]
            key, rv = f"{meta.get('namespace')}/{meta['name']}", str(meta.get("resourceVersion") or "")
            hit = self._opted_in.get(key)
            if hit is not None and rv and hit[0] == rv:
                opted = hit[1]
            else:
                opted = False
                for comp in F.dgd_components(dgd):
                    if not comp.is_worker:
                        continue
                    parsed = parse_policy(F.annotations_of(dgd), comp.annotations)
                    if parsed.policy is not None and parsed.policy.enabled:
                        opted = True
                        break
            known[key] = (rv, opted)
            if opted:
                out.append(dgd)
        self._opted_in = known
        return out

    async def scrape_once(self) -> None:
        graphs = self.opted_in_graphs()

        async def one(dgd: Obj) -> None:
            ns, name = dgd["metadata"].get("namespace"), dgd["metadata"]["name"]
            key = f"{ns}/{name}"
            url = F.frontend_url(self.pods.store, ns, name)
            demand: Demand | None = None
            if url is not None:
                try:
                    demand = await self.frontend.demand(url)
                    self.metrics.frontend_scrape("ok")
                except FrontendError as e:
                    self.metrics.frontend_scrape("error")
                    log.debug("%s: %s", key, e)
            before = self.reconciler.demand.get(key)
            self.reconciler.demand[key] = demand
            if self._matters(dgd, before, demand):
                log.info("%s: demand %s -> %s", key, before, demand)
                self._enqueue_graph(key, skip=self.demand_skips(before, demand))

        # 16 scrapes at a time, by 16 tasks that take the graphs in turn (not a task per graph each
        # interval: hundreds of graphs made task creation a visible share of the controller's CPU).
        todo = iter(graphs)

        async def scraper() -> None:
            for dgd in todo:
                await one(dgd)

        await asyncio.gather(*(scraper() for _ in range(min(16, len(graphs)))))
        live = {f"{d['metadata'].get('namespace')}/{d['metadata']['name']}" for d in graphs}
        for k in set(self.reconciler.demand) - live:
            self.reconciler.demand.pop(k, None)
        self.reconciler.ctx.models.prune(live)  # a graph no longer opted in (or gone) is asked afresh

    @staticmethod
    def _matters(dgd: Obj, before: Demand | None, after: Demand | None) -> bool:
        """A demand change requeues the graph only when some component's need changes (or it
        becomes known/unknown): a busy frontend's every tick would otherwise requeue everything."""
        if before == after:
            return False  # the common case, every interval for every quiet graph: no policy to parse
        if (before is None) != (after is None):
            return True
        for comp in F.dgd_components(dgd):
            parsed = parse_policy(F.annotations_of(dgd), comp.annotations)
            if comp.is_worker and parsed.policy is not None and \
                    needed(parsed.policy, before) != needed(parsed.policy, after):
                return True
        return False

    async def scrape_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.scrape_once()
            except Exception:
                log.exception("frontend scrape failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.scrape_interval)

    async def reconcile_loop(self, stop: asyncio.Event) -> None:
        for pod in self.pods.store.list():  # everything once: finish what an earlier leader left
            if F.is_worker_pod(pod):
                self.queue.add(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}")
        try:
            await run_until_stopped(run_workers(self.queue, self.reconcile, workers=self.settings.workers,
                                                name="controller", timeout=self.settings.reconcile_timeout),
                                    stop, on_stop=self.queue.shutdown)
        finally:
            self.queue.shutdown()

    def runnables(self) -> list[tuple[str, Callable[[asyncio.Event], Any]]]:
        return [("frontend demand", self.scrape_loop), ("reconcile", self.reconcile_loop)]

    async def close(self) -> None:
        self.queue.shutdown()
        await self.frontend.close()


async def run_controller(kube: Kube, settings: ControllerSettings, *, stop: asyncio.Event,
                         identity: str = "") -> None:
    """Run until ``stop`` on the runtime manager: informers and their first list, then (when this
    replica leads) the reconcile workers and the demand loop. Raises ``LeadershipLost`` when the
    Lease is lost: every runnable is cancelled at once and the process should exit non-zero so its
    Deployment restarts it as a fresh candidate."""
    identity = identity or settings.identity or f"{socket.gethostname()}-{os.getpid()}"
    ctl = Controller(kube, settings, identity=identity)
    elector = None
    if settings.leader_elect:
        elector = LeaderElector(Leases(kube, namespace=settings.lease_namespace, identity=identity),
                                settings.lease_name, lease_duration=settings.lease_duration,
                                renew_deadline=settings.renew_deadline, retry_period=settings.retry_period)
    manager = Manager("controller", informers=ctl.informers, health_host=settings.health_host,
                      health_port=settings.health_port, metrics=ctl.metrics.render, elector=elector)

    async def announce(stop: asyncio.Event) -> None:
        log.info("controller %s leading: %d graphs, %d pods, %d WorkerSnapshots; /healthz, /readyz, /metrics on "
                 "port %s", identity, len(ctl.dgds.store), len(ctl.pods.store), len(ctl.wss.store), manager.port)

    manager.add("announce", announce)
    for name, fn in ctl.runnables():
        manager.add(name, fn)
    try:
        await manager.run(stop)
    finally:
        await ctl.close()
