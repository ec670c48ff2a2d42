"""Issue 19's long sleep, overlapped with the rest of tests/integration/node: a graph of its own
(examples/dgd/agg.yaml under the local overlay, tier snapshot, DGD ``long-sleep``) deployed when the
package starts, one of its workers put to sleep through the override, and kubelet's account of it
read every 5 s while the package's other suites run on the same node; node/test_long_sleep.py, which
node/conftest.py orders last in the package, then rolls the agent by ``helm upgrade``, wakes the worker
through the next agent and asserts what the looks saw. Six minutes of sleep had a module of their own
before; here they cost the run the start and the end only. They are also longer than Dynamo's watches
last (kube-client asks ``timeoutSeconds=290``): the session API server's audit log (auditlog.py) gives
the watches the worker had open when it was frozen, which the server ends while it sleeps.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from auditlog import AuditLog, Watch
from controllerenv import asleep, get_ws
from realnodecycle import override, ready_is, wait_ws
from realnodeenv import WORKER_COMPONENT, Env
from realnodefacts import KubeletFacts, container_procs, kubelet_facts

from dynsnap.k8s.client import Obj
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import NodePod

GRAPH = "long-sleep"
ASLEEP_S = 360.0  # six minutes: the least the sleep lasts (the package's other suites take longer)
LOOK_EVERY_S = 5.0  # as often as the example's liveness probe
MAX_LOOKS = 480  # 40 minutes of looks at most: longer than the package runs
LIVENESS = {"periodSeconds": 5, "failureThreshold": 3}  # as examples/dgd/agg.yaml ships them
WATCHED = {"endpointslices", "dynamoworkermetadatas"}  # what a Dynamo 1.6.1 worker watches (DESIGN.md 3.4)
RESTART_SLACK = timedelta(seconds=10)  # a look begun this long before an API server restart may fail by it


def open_watches(env: Env, audit: AuditLog, w: NodePod) -> list[Watch]:
    """The worker's watches the running API server has open (started since it started, not ended)."""
    assert env.cluster.cp is not None
    return [x for x in audit.watches(w.ip, since=env.cluster.cp.apiserver_started) if x.ended is None]


async def watching(env: Env, audit: AuditLog, w: NodePod) -> None:
    """Until the worker has both its watches open (not in a reconnect's backoff): what a capture then
    freezes in the image."""
    async def both() -> bool:
        return {x.resource for x in open_watches(env, audit, w)} >= WATCHED
    await wait_for(f"{w.name} watching {sorted(WATCHED)} (the audit log)", both, timeout=120, interval=1)


def watched_since(audit: AuditLog, w: NodePod, since: datetime) -> bool:
    """The worker opened both its watches after ``since`` (the audit log)."""
    return {x.resource for x in audit.watches(w.ip, since=since)} >= WATCHED


@dataclass
class LongSleep:
    """The sleeping worker and what was seen of it: ``looks`` (kubelet's account every 5 s) and ``wrong``
    (each look that differed from the first: another container, a restart, not running, Ready, PID 1
    gone, the WorkerSnapshot awake or holding another capture, or a look that could not be taken)."""

    env: Env
    graph: real_graph.Graph
    fe: D.FrontendClient
    worker: NodePod
    first: KubeletFacts
    entrypoint: int
    slept: Obj  # the WorkerSnapshot once asleep
    since: float  # time.monotonic() when it was seen asleep
    audit: AuditLog
    frozen: list[Watch]  # the worker's watches open when it was frozen (the server will end them)
    looks: list[KubeletFacts] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # looks not taken while the API server was restarted
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._look_all_along())

    async def stop_looking(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _look_all_along(self) -> None:
        capture = self.slept["status"]["lastCapture"]["id"]
        cp = self.env.cluster.cp
        assert cp is not None
        for _ in range(MAX_LOOKS):
            began = datetime.now(UTC)
            try:
                now = await kubelet_facts(self.env.api, self.worker)
                self.looks.append(now)
                if (now.container_id, now.restart_count, now.running, now.ready) != (
                        self.first.container_id, self.first.restart_count, True, False):
                    self.wrong.append(f"kubelet: {now}")
                if procfs.status(self.entrypoint) is None:
                    self.wrong.append(f"the container's PID 1 {self.entrypoint} is gone")
                ws = await get_ws(self.env.api, self.worker)
                if not asleep(ws) or ws is None or ws["status"]["lastCapture"]["id"] != capture:
                    self.wrong.append(f"WorkerSnapshot: {(ws or {}).get('status')}")
            except Exception as e:  # a look not taken is not a look that saw it fine
                # unless another suite had restarted the API server meanwhile (node/test_apiserver_restart.py)
                during = cp.apiserver_restarted_within(began - RESTART_SLACK, datetime.now(UTC))
                (self.skipped if during else self.wrong).append(f"no look: {type(e).__name__}: {e}")
            await asyncio.sleep(LOOK_EVERY_S)

    async def remaining(self) -> None:
        """Until ``ASLEEP_S`` have passed since it slept (at once when the package took longer)."""
        left = ASLEEP_S - (time.monotonic() - self.since)
        if left > 0:
            await asyncio.sleep(left)


@contextlib.asynccontextmanager
async def sleeping(env: Env, audit: AuditLog) -> AsyncIterator[LongSleep]:
    """The long-sleep graph deployed Ready, one worker asleep (tier snapshot) with both its watches open
    when frozen, and looked at from then on; the graph deleted after. ``env.graph``/``env.fe`` stay the
    tests' (this graph is not theirs)."""
    body = chart_node.example_body(env, policy={"dynsnap.io/tier": "snapshot"}, name=GRAPH)
    graph = await chart_node.deploy_example(env, body)
    fe = env.fe
    assert fe is not None
    env.graph, env.fe = None, None  # the next test's deploy must neither take nor close them
    try:
        w = graph.workers(WORKER_COMPONENT)[0]
        first = await kubelet_facts(env.api, w)
        ep = container_procs(w.uid, first.container_id).entrypoint
        await watching(env, audit, w)
        await override(env, w, "suspended")
        slept = await wait_ws(env, w, "the long sleep's worker asleep (snapshot)", asleep)
        assert slept["status"]["lastCapture"]["ok"] is True and slept["status"]["lastCapture"]["tier"] == "snapshot"
        frozen = [x for x in open_watches(env, audit, w) if x.resource in WATCHED]
        assert {x.resource for x in frozen} == WATCHED and all(x.timeout_seconds for x in frozen), \
            [x.uri for x in frozen]
        await wait_for(f"{w.name} not Ready while asleep", lambda: ready_is(env, w, False), timeout=60, interval=0.5)
        sleep = LongSleep(env, graph, fe, w, first, ep, slept, time.monotonic(), audit, frozen)
        sleep.start()
        try:
            yield sleep
        finally:
            await sleep.stop_looking()
    finally:
        await fe.close()
        chart_node.keep_pod_logs(env)
        await real_graph.teardown(env.api, graph)
        env.graphs.remove(graph)
