"""``dynsnap agent``: the node agent process. Starts two informers (this node's WorkerSnapshots by
their ``dynsnap.io/node`` label; the pods bound to this node), waits for their first list, then
reconciles with a few workers; deletes images of pods gone from the node every ``gc_interval``; serves
``/healthz`` and ``/readyz``; stops cleanly on SIGTERM.

Layer: ``dynsnap.agent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from dynsnap.agent.executor import Executor
from dynsnap.agent.node import NodeAgent
from dynsnap.agent.settings import AgentSettings
from dynsnap.k8s.client import Kube
from dynsnap.k8s.events import EventRecorder
from dynsnap.k8s.informer import Informer
from dynsnap.k8s.store import label, owner_uids, pod_node
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.runtime.health import HealthServer

log = logging.getLogger(__name__)

SYNC_TIMEOUT = 120.0


async def run_agent(kube: Kube, settings: AgentSettings, *, stop: asyncio.Event | None = None,
                    instance: str = "") -> None:
    if not settings.node_name:
        raise ValueError("the agent needs its node name (--node-name, or DYNSNAP_AGENT_NODE_NAME from spec.nodeName)")
    stop = stop or asyncio.Event()
    ws_inf = Informer(kube, R.WORKER_SNAPSHOTS, label_selector=f"{P.LABEL_NODE}={settings.node_name}",
                      indexers={"node": label(P.LABEL_NODE)}, name="workersnapshots")
    pod_inf = Informer(kube, R.PODS, field_selector=f"spec.nodeName={settings.node_name}",
                       indexers={"node": pod_node, "owner": owner_uids}, name="pods")
    agent = NodeAgent(kube=kube, settings=settings, executor=Executor(settings),
                      events=EventRecorder(kube, reporting_controller=f"{P.DYNSNAP_GROUP}/agent",
                                           reporting_instance=instance or f"dynsnap-agent-{settings.node_name}"))
    agent.ws_informer, agent.pod_informer = ws_inf, pod_inf
    ws_inf.add_handler(agent.on_ws)
    pod_inf.add_handler(agent.on_pod)
    ready = False
    health = HealthServer(host="0.0.0.0", port=settings.health_port, ready=lambda: ready,
                          metrics=agent.metrics.render) if settings.health_port else None
    tasks: list[asyncio.Task[object]] = []
    try:
        if health is not None:
            await health.start()
        tasks += [ws_inf.start(), pod_inf.start()]
        await ws_inf.wait_synced(SYNC_TIMEOUT)
        await pod_inf.wait_synced(SYNC_TIMEOUT)
        ready = True
        log.info("agent on %s: %d WorkerSnapshots, %d pods; reconciling", settings.node_name, len(ws_inf.store),
                 len(pod_inf.store))
        for obj in ws_inf.store.list():  # everything, once: finish or roll back what an earlier agent left
            agent.on_ws("SYNC", obj)
        tasks.append(asyncio.create_task(agent.run(), name="agent workers"))
        tasks.append(asyncio.create_task(_gc_loop(agent, stop), name="agent image gc"))
        stopper = asyncio.create_task(stop.wait())
        failed = [ws_inf.start(), pod_inf.start()]
        done, _ = await asyncio.wait([stopper, *failed, tasks[-2]], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stopper and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        agent.queue.shutdown()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await ws_inf.stop()
        await pod_inf.stop()
        if health is not None:
            await health.stop()


async def _gc_loop(agent: NodeAgent, stop: asyncio.Event) -> None:
    while not stop.is_set():
        removed = agent.gc_images()
        if removed:
            log.info("deleted images of pods gone from this node: %s", removed)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), agent.settings.gc_interval)


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
