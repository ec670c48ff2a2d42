"""The API server restarted mid-wake on the real node (issue 8's fault matrix, its API-server row): the
session's own API server is stopped while the agent's resume of a snapshot wake is held by the stub
driver, and started again with the same flags once the wake has gone on without it. Every client of it
on the node (kubelet, the chart's agent and controller, the Dynamo pods, the long sleep's looks) has to
come back by itself, as in a cluster whose control plane is upgraded under running workers.

What must hold:

- the agent ends the wake without the server (the entrypoint active while it is down), and its status
  writes fail meanwhile (its log as kubelet keeps it on the node's disk: ``kubectl logs`` needs the server);
- once it is back, every step's record reaches status, those whose writes failed included, with no
  error and Degraded False; the controller, which lost its lease while the server was down, is
  restarted by kubelet in its pod, and verifies the wake with pinned requests;
- the worker watches the restarted server again on new connections (its audit log), none of those it held
  before the stop left; the same pod, container and restartCount, answering pinned requests;
- the agent's informers reconnected: a sleep and a wake asked after the restart are done.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime

import pytest
import yaml
from agentenv import tcp_established
from auditlog import AuditLog
from controllerenv import asleep, cond, get_ws, verified_after
from helperprocs import helpers_for
from longsleep import watched_since
from realnodecycle import cycle, override, pinned, proven, same_pod, wait_ws
from realnodeenv import NS, Env, chart_pod, deployed, kubernetes_service
from realnodefacts import container_procs, control_file, kubelet_facts

from dynsnap.k8s.client import Obj
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

WORKER = "VllmWorker"
# The resume is held this long: time enough to stop the API server (SIGTERM, exit) while it runs.
RESUME_HANG_MS = 15_000


def _gave_up(env: Env, agent: Obj, w: NodePod) -> int:
    """The agent's status writes for ``w``'s WorkerSnapshot that its retry policy gave up on (its log as
    kubelet keeps it on the node: readable while the API server is down)."""
    pattern = re.compile(rf"gave up on PATCH \S*/workersnapshots/{re.escape(w.name)}/status\b")
    return len(pattern.findall(env.log_on_disk(NS, agent["metadata"]["name"], "agent")))


def _restarts(pod: Obj, container: str) -> int:
    return int(next(c for c in pod["status"]["containerStatuses"] if c["name"] == container)["restartCount"])


async def test_the_api_server_restarted_mid_wake(env: Env, audit: AuditLog) -> None:
    body = chart_node.example_body(env, name="api-restart", worker_replicas=2, policy={"dynsnap.io/tier": "snapshot"})
    async with deployed(env, body) as g:
        w = g.workers(WORKER)[0]
        first = await kubelet_facts(env.api, w)
        ep = container_procs(w.uid, first.container_id).entrypoint
        pidns = os.stat(f"/proc/{ep}/ns/pid").st_ino
        api_server = await kubernetes_service(env)
        agent = await chart_pod(env, "agent")
        controller = await chart_pod(env, "controller")
        await pinned(env, w, n=1)
        before = (((await get_ws(env.api, w)) or {}).get("status") or {}).get("lastWake", {}).get("id")
        await override(env, w, "suspended")
        await wait_ws(env, w, "asleep (snapshot)", asleep)
        failed_before = _gave_up(env, agent, w)
        env.driver.control(f"hang cuCheckpointProcessRestore * {RESUME_HANG_MS}")
        try:
            await override(env, w, "active")

            async def resuming() -> bool:
                return any(h.op == "resume" for h in helpers_for(pidns, ep))
            await wait_for("the wake's resume (dynsnap-cuda) in flight", resuming, timeout=90, interval=0.2)
            restored = tcp_established(ep, remote=api_server)

            async def woken() -> bool:
                return control_file(ep)["state"] == "active"

            async def write_failed() -> bool:
                return _gave_up(env, agent, w) > failed_before

            async def while_down() -> None:
                assert any(h.op == "resume" for h in helpers_for(pidns, ep)), \
                    "the resume was over before the API server went down"
                # The rest of the wake is the node's business: the agent ends it without the server,
                # and its status writes fail meanwhile.
                await wait_for("the entrypoint active while the API server is down", woken, timeout=120)
                await wait_for("a status write the agent gave up on while the API server is down", write_failed,
                               timeout=60, interval=0.5)

            stopped_at = datetime.now(UTC)
            await env.cluster.restart_apiserver(while_down=while_down)
        finally:
            env.driver.clear_faults()
        # Every step's record, those whose writes failed included, reaches status once the server is back,
        # and the controller (which lost its lease with the server) verifies the wake.
        woken_ws = await wait_ws(env, w, "woken and verified after the restart", verified_after(before), timeout=300)
        st = woken_ws["status"]
        wake = await proven(env, w, woken_ws, "snapshot")
        assert wake.get("error") is None, yaml.safe_dump(st)
        assert [s["name"] for s in wake["steps"]] == ["wake", "restore", "resume", "settle-active"], yaml.safe_dump(st)
        assert st.get("lastError") is None and not st.get("consecutiveFailures"), yaml.safe_dump(st)
        degraded = cond(woken_ws, "Degraded")
        assert degraded is not None and degraded["status"] == "False", yaml.safe_dump(st)
        # Down longer than its lease's renew deadline (10 s), the controller lost its leadership and its
        # process exited (dynsnap.runtime.manager, as client-go's controllers do); kubelet restarted it in
        # its pod, and the verification above is the new process's. The agent, which holds no lease, did not.
        now = await chart_pod(env, "controller")
        assert now["metadata"]["uid"] == controller["metadata"]["uid"]
        assert _restarts(now, "controller") == _restarts(controller, "controller") + 1, now["status"]
        assert _restarts(await chart_pod(env, "agent"), "agent") == _restarts(agent, "agent")
        # The worker itself: the stop closed its connections (restored before it); it watches again.

        async def watching_again() -> bool:
            now = tcp_established(ep, remote=api_server)
            return watched_since(audit, w, stopped_at) and bool(now) and not now & restored
        await wait_for("the worker watching the restarted API server on new connections", watching_again,
                       timeout=120, interval=1)
        await same_pod(env, w, first)
        await pinned(env, w)

        # The agent's informers reconnected: it acts on changes made after the restart.
        async def nothing(_: Obj) -> None:
            pass
        await cycle(env, w, "snapshot", nothing)
        await same_pod(env, w, first)
        await pinned(env, w, n=1)
