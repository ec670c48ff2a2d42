"""``dynsnap agent``: the node agent process. On ``dynsnap.runtime.manager.Manager`` (no leader
election: one agent per node): two informers (this node's WorkerSnapshots by their
``dynsnap.io/node`` label; the pods bound to this node), their first list awaited, then two
runnables: the reconcile workers, and the deletion of images of pods gone from the node every
``gc_interval``. Serves ``/healthz``, ``/readyz`` and ``/metrics`` (the agent's metrics); stops
cleanly on SIGTERM. An informer that gives up or a worker loop that fails ends the process with
that error.

Layer: ``dynsnap.agent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from dynsnap.agent.executor import Executor
from dynsnap.agent.node import NodeAgent
from dynsnap.agent.settings import AgentSettings
from dynsnap.k8s.client import Kube
from dynsnap.k8s.events import EventRecorder
from dynsnap.k8s.informer import Informer
from dynsnap.k8s.store import label, owner_uids, pod_node
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.runtime.manager import Manager, run_until_stopped

log = logging.getLogger(__name__)

SYNC_TIMEOUT = 120.0


async def run_agent(kube: Kube, settings: AgentSettings, *, stop: asyncio.Event | None = None,
                    instance: str = "", metrics: Callable[[], str] | None = None) -> None:
    """Run the agent until ``stop``; raises what ended it otherwise (an informer that gave up, a
    worker loop that failed). ``metrics`` renders ``/metrics`` (Prometheus text) instead of the agent's own."""
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

    async def reconcile(stop: asyncio.Event) -> None:
        log.info("agent on %s: %d WorkerSnapshots, %d pods; reconciling", settings.node_name, len(ws_inf.store),
                 len(pod_inf.store))
        for obj in ws_inf.store.list():  # everything, once: finish or roll back what an earlier agent left
            agent.on_ws("SYNC", obj)
        # On stop the reconciles in flight are cancelled, not waited for: a capture can take minutes,
        # and every step is safe to cut (its helpers die with it; the next agent finishes or rolls back).
        try:
            await run_until_stopped(agent.run(), stop, on_stop=agent.queue.shutdown)
        finally:
            agent.queue.shutdown()

    # One agent per node: no leader election. The health port 0 means no health server.
    manager = Manager(f"agent {settings.node_name}", informers=[ws_inf, pod_inf],
                      health_port=settings.health_port or None, metrics=metrics or agent.metrics.render,
                      sync_timeout=SYNC_TIMEOUT)
    manager.add("workers", reconcile)
    manager.add("image gc", lambda stop: _gc_loop(agent, stop))
    manager.add("wake on request", agent.watch_routable)
    await manager.run(stop)


async def _gc_loop(agent: NodeAgent, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            removed = agent.gc_images()
        except OSError:  # a disk error is the next pass's to retry; it must not end the agent
            log.exception("deleting images of pods gone from this node failed; again in %.0f s",
                          agent.settings.gc_interval)
            removed = []
        if removed:
            log.info("deleted images of pods gone from this node: %s", removed)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), agent.settings.gc_interval)


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
