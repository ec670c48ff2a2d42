"""The node agent and Dynamo workers across the API server's own behaviour (issue 8's fault matrix, the
API-server rows), on a local cluster of their own (apiserver_env.py): its API server is restarted, and
its audit log shows what each worker asks of it and when the server ends each watch.

1. The API server restarted mid-wake: the agent finishes the wake without it, keeps the records of the
   steps whose status writes failed and writes them once it is back, and its informers reconnect; the
   worker itself watches again on new connections, keeps its DWM and is routed to by the frontend.
2. Workers asleep longer than the API server keeps their watch streams open: the server ends them
   while the workers' connections are frozen in a CRIU image. Woken, the workers serve at once (same
   DWM, routed to by the frontend) and watch again; how soon depends on how their connections come
   back (see the test's docstring).

Sandbox, why: it restarts the API server of a cluster of its own and reads that server's audit log;
no real node is built on that second cluster yet.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from agentenv import (
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    StubDriver,
    apiserver_addr,
    build_stub_driver,
    condition,
    deploy_serving,
    established,
    eventually,
    gather_stop,
    install_dynsnap,
    quiesce,
    set_desired,
    state_is,
    token_kubeconfig,
    wait_ws,
    worker_component,
    ws_body,
)
from apiserver_env import (
    apiserver_cluster,
    helpers,
    keep_logs,
    leftovers,
    server_ends,
    tcp_close_criu,
)
from auditlog import AuditLog, Watch

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, RunningPod

pytestmark = pytest.mark.cluster

# The resume is held this long: time enough to stop the API server (SIGTERM, exit) while it runs.
RESUME_HANG_MS = 15_000
WATCHED = {"endpointslices", "dynamoworkermetadatas"}  # what a Dynamo 1.6.1 worker watches (DESIGN.md 3.4)
# kube-client 2.0.1 (Dynamo 1.6.1's Kubernetes client) gives up on a response that sent no byte for
# this long (its default read_timeout); measured here to count from the restore.


@dataclass
class Env:
    cluster: LocalCluster
    audit: AuditLog
    graph: D.Graph
    fe: D.FrontendClient
    agents: list[AgentProc]
    driver: StubDriver
    ids: dict[str, int]

    def agent_for(self, pod: RunningPod) -> AgentProc:
        return next(a for a in self.agents if a.node == pod.node)


@pytest.fixture(scope="module")
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    """One frontend and two workers, ``api-worker-0`` on node-a and ``api-worker-1`` on node-b. The
    agent of node-a is the agent as shipped; the agent of node-b restores with --tcp-close
    (apiserver_env.tcp_close_criu), the second way of coming back that test 2 compares. The cluster is torn
    down whatever happens; its logs (and the audit log) are kept when a test failed."""
    work = Path(tempfile.mkdtemp(prefix="dynsnap-apiserver-"))
    cluster, audit = apiserver_cluster(work)
    try:
        await cluster.start()
        driver = build_stub_driver(work / "stubcuda")
        await install_dynsnap(cluster)
        kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
        g = await deploy_serving(cluster, D.dgd("api", [D.frontend_component(),
                                                        worker_component("worker", replicas=2, driver=driver)]))
        criu, criu_env = tcp_close_criu(work / "tcp-close-criu")
        agents = [AgentProc(NODES[0], kubeconfig, work / NODES[0], driver),
                  AgentProc(NODES[1], kubeconfig, work / NODES[1], driver, extra=["--criu", str(criu)], env=criu_env)]
        fe = D.FrontendClient(g.frontend)
        try:
            for a in agents:
                await a.start()
            await fe.wait_model()
            ids = {p.name: await D.instance_id(cluster, p) for p in g.workers("worker")}
            for wid in ids.values():
                await fe.wait_routable(wid)
            yield Env(cluster, audit, g, fe, agents, driver, ids)
        finally:
            await fe.close()
            await gather_stop(agents)
            await D.teardown(cluster, g)
        broken = cluster.failed_components()
        assert not broken, "components died:\n" + "\n".join(broken)
    finally:
        await cluster.stop()
        left = leftovers(cluster)
        if request.session.testsfailed or left:
            print(f"\napiserver cluster logs kept in {keep_logs(work, 'apiserver-cluster').resolve()}")
        shutil.rmtree(work, ignore_errors=True)
        assert not left, "the cluster left things behind:\n" + "\n".join(left)


async def _identity(cluster: LocalCluster, pod: RunningPod) -> dict[str, object]:
    p = await cluster.api.get(R.PODS, pod.name, namespace=pod.namespace)
    dwm = await cluster.api.get(R.DWMS, pod.name, namespace=pod.namespace)
    return {"uid": p["metadata"]["uid"], "ip": p["status"]["podIP"], "dwm": dwm["metadata"]["uid"],
            "instance": instance_id_from_dwm(dwm)}


async def _pinned(env: Env, pod: RunningPod, n: int = 2) -> None:
    wid = env.ids[pod.name]
    await env.fe.wait_routable(wid)
    for i in range(n):
        res = await env.fe.chat(f"pinned {i}", worker_id=wid)
        assert res.status == 200 and res.worker_id == wid, res.body


def _ep_state(pod: RunningPod) -> str:
    path = Path(f"/proc/{pod.sandbox.pid}/root") / P.ENTRYPOINT_CONTROL_DIR.lstrip("/") / P.ENTRYPOINT_CONTROL_FILE
    return str(json.loads(path.read_text())["state"])


def _failed_status_writes(agent: AgentProc, pod: RunningPod) -> int:
    """The agent's status writes for ``pod``'s WorkerSnapshot that its retry policy gave up on."""
    pattern = re.compile(rf"gave up on PATCH \S*/workersnapshots/{re.escape(pod.name)}/status\b")
    return len(pattern.findall(agent.log_path.read_text(errors="replace")))


def _steps(ws: Obj) -> list[str]:
    return [s["name"] for s in ws["status"]["lastWake"]["steps"]]


async def _sleep_and_wake(env: Env, pod: RunningPod) -> None:
    api = env.cluster.api
    await quiesce(env.cluster, pod, serving=False)
    await set_desired(api, pod, "Suspended")
    await wait_ws(api, pod, "Suspended", state_is("Suspended", suspended=True), agents=env.agents)
    await set_desired(api, pod, "Active")
    await wait_ws(api, pod, "Active", state_is("Active", suspended=False), agents=env.agents)
    await quiesce(env.cluster, pod, serving=True)


def _open_watches(env: Env, pod: RunningPod) -> list[Watch]:
    """The worker's watches the running API server has open (started, not ended)."""
    assert env.cluster.cp is not None
    return [w for w in env.audit.watches(pod.ip, since=env.cluster.cp.apiserver_started) if w.ended is None]


def _watching_since(env: Env, pod: RunningPod, since: datetime, *, frozen: set[tuple[str, str]] | None = None
                    ) -> Callable[[], Awaitable[bool]]:
    """The worker watches the API server again: it opened both watches after ``since``, it holds
    connections to the server, the server holds their other end (none half-open), and (``frozen``)
    none of them is one of those given."""
    async def check() -> bool:
        started = {w.resource for w in env.audit.watches(pod.ip) if w.started > since}
        conns = established(pod, remote=apiserver_addr(env.cluster))
        return (started >= WATCHED and bool(conns) and server_ends(conns) == conns
                and not (frozen and conns & frozen))
    return check


async def test_apiserver_restarted_mid_wake(env: Env) -> None:
    cluster, api = env.cluster, env.cluster.api
    pod = env.graph.workers("worker")[0]
    agent = env.agent_for(pod)
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    try:
        await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=env.agents)
        before = await _identity(cluster, pod)
        await _pinned(env, pod, n=1)
        await quiesce(cluster, pod, serving=False)
        await set_desired(api, pod, "Suspended")
        await wait_ws(api, pod, "Suspended", state_is("Suspended", suspended=True), agents=env.agents)
        failed_before = _failed_status_writes(agent, pod)
        env.driver.control(f"hang cuCheckpointProcessRestore * {RESUME_HANG_MS}")
        try:
            await set_desired(api, pod, "Active")

            async def resuming() -> bool:
                return bool(helpers(pod, "resume"))
            await eventually("the wake's resume (dynsnap-cuda) in flight", resuming, timeout=90)
            restored = established(pod, remote=apiserver_addr(cluster))

            async def woken() -> bool:
                return _ep_state(pod) == "active"

            async def write_failed() -> bool:
                return _failed_status_writes(agent, pod) > failed_before

            async def while_down() -> None:
                assert helpers(pod, "resume"), "the resume was over before the API server went down"
                # The rest of the wake is the node's business: the agent ends it without the server,
                # and its status writes fail meanwhile.
                await eventually("the entrypoint active while the API server is down", woken, timeout=120)
                await eventually("a status write the agent gave up on while the API server is down",
                                 write_failed, timeout=60)

            stopped_at = datetime.now(UTC)
            await cluster.restart_apiserver(while_down=while_down)
        finally:
            env.driver.clear_faults()
        # Every step's record, those whose writes failed included, reaches status once the server is back.
        ws = await wait_ws(api, pod, "Active after the restart", state_is("Active", suspended=False),
                           timeout=120, agents=env.agents)
        st = ws["status"]
        assert st["lastWake"]["ok"] is True and st["lastWake"].get("error") is None, yaml.safe_dump(st)
        assert _steps(ws) == ["wake", "restore", "resume", "settle-active"], yaml.safe_dump(st)
        assert st.get("lastError") is None and not st.get("consecutiveFailures"), yaml.safe_dump(st)
        degraded = condition(ws, "Degraded")
        assert degraded is not None and degraded["status"] == "False", yaml.safe_dump(st)
        # The worker itself: the restart closed its connections (restored before it); it watches again.
        await eventually("the worker watching the restarted API server on new connections",
                         _watching_since(env, pod, stopped_at, frozen=restored), timeout=120)
        await quiesce(cluster, pod, serving=True)
        assert await _identity(cluster, pod) == before, "same pod UID, IP, DWM (not recreated) and instance id"
        await _pinned(env, pod)
        # The agent's informers reconnected: it acts on changes made after the restart.
        await _sleep_and_wake(env, pod)
        assert await _identity(cluster, pod) == before
        await _pinned(env, pod, n=1)
        assert pod.kubelet.restarts == 0
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)


@pytest.mark.timeout(1500)
async def test_workers_asleep_past_their_watch_timeout(env: Env) -> None:
    """Dynamo 1.6.1's worker watches through kube-rs (kube-client 2.0.1), which puts
    ``timeoutSeconds=290`` on every watch (the audit log shows it). The API server keeps a watch open
    for the timeoutSeconds its client asks; its --min-request-timeout applies only to watches that ask
    none, so it cannot shorten these. This test therefore sleeps both workers until the server has
    ended every watch they had open, up to 290 s after the newest began (it waits on the audit log,
    not on a clock), then wakes them.

    The server ended those streams into connections frozen in the images (CRIU's network lock drops
    their packets), closes the connections 90 s later (its idle timeout) and drops its end without a
    reset once its retransmissions give up. Restored as they were, such connections are half-open:
    nothing arrives on them, and the worker would watch again only when kube-client's read timeout
    (295 s) gave up on them (seen before the agent reset them: 275-294 s after the wake). The agent as
    shipped (node-a) therefore resets the woken worker's connections to the API server after a sleep
    longer than --reset-apiserver-connections-after (30 s), and only those: it watches again at once
    on new connections, and the frontend's connections to it are kept. Restored closed (node-b, CRIU
    --tcp-close, the alternative not taken), it watches again at once too, but every connection is
    closed under its peers: the frontend's first request over one fails (reset by peer) before it
    reconnects. Both serve at once, keep their DWM and are routed to. About 6 minutes in all, nearly
    all of it the server's watch timeout, which no server flag shortens.
    """
    cluster, api = env.cluster, env.cluster.api
    shipped, closed = env.graph.workers("worker")
    pods = [shipped, closed]
    assert (shipped.node, closed.node) == (NODES[0], NODES[1])
    for p in pods:
        await api.create(R.WORKER_SNAPSHOTS, ws_body(p, tier="snapshot"))
    try:
        before, pre, frozen = {}, {}, {}
        for p in pods:
            await wait_ws(api, p, "Accepted, Active", state_is("Active"), agents=env.agents)
            before[p.name] = await _identity(cluster, p)
            await _pinned(env, p, n=1)
            await quiesce(cluster, p, serving=False)
        for p in pods:  # both watches open (not in a reconnect backoff), to be frozen in the image
            async def watching(p: RunningPod = p) -> bool:
                return {w.resource for w in _open_watches(env, p)} == WATCHED
            await eventually(f"{p.name} watching {WATCHED}", watching, timeout=120)
            pre[p.name] = established(p, remote=apiserver_addr(cluster))
            assert pre[p.name], "the worker holds connections to the API server (its discovery watches)"
            await set_desired(api, p, "Suspended")
        for p in pods:
            await wait_ws(api, p, "Suspended", state_is("Suspended", suspended=True), agents=env.agents)
            assert _ep_state(p) == "snapshotted"
            frozen[p.name] = _open_watches(env, p)
            assert {w.resource for w in frozen[p.name]} == WATCHED, frozen[p.name]
            assert all(w.timeout_seconds for w in frozen[p.name]), [w.uri for w in frozen[p.name]]
        open_watches: list[Watch] = [w for ws_ in frozen.values() for w in ws_]
        ends_by = max(w.ends_by for w in open_watches if w.ends_by is not None)

        async def all_ended() -> bool:
            still = {w.audit_id for p in pods for w in _open_watches(env, p)}
            return not any(w.audit_id in still for w in open_watches)
        await eventually("the API server ending every watch the sleeping workers had open", all_ended,
                         timeout=max((ends_by - datetime.now(UTC)).total_seconds(), 0) + 60)
        for p in pods:  # the server ended them while the workers slept
            ws = await api.get(R.WORKER_SNAPSHOTS, p.name, namespace=p.namespace)
            assert state_is("Suspended", suspended=True)(ws) and _ep_state(p) == "snapshotted"
        woken_at = datetime.now(UTC)
        for p in pods:
            await set_desired(api, p, "Active")
        for p in pods:
            ws = await wait_ws(api, p, "Active", state_is("Active", suspended=False), agents=env.agents, timeout=120)
            assert ws["status"]["lastWake"]["ok"] is True, yaml.safe_dump(ws["status"])
            assert _steps(ws) == ["wake", "restore", "resume", "settle-active"], yaml.safe_dump(ws["status"])
            await quiesce(cluster, p, serving=True)
        for p in pods:  # serving at once, whatever became of its watches
            assert await _identity(cluster, p) == before[p.name], "same pod UID, IP, DWM (not recreated), instance id"
            await _pinned(env, p)
        # Restored closed: none of the frozen connections is left; the worker watched again at once.
        await eventually("the worker restored with --tcp-close watching again on new connections",
                         _watching_since(env, closed, woken_at, frozen=pre[closed.name]), timeout=60)
        # Restored as they were, its API-server connections reset by the agent: none of the frozen ones
        # is left and it watches again at once, not after kube-client's read timeout.
        await eventually("the worker woken by the shipped agent watching again on new connections",
                         _watching_since(env, shipped, woken_at, frozen=pre[shipped.name]), timeout=60)
        log_text = env.agent_for(shipped).log_path.read_text(errors="replace")
        assert re.search(r"reset [1-9]\d* connection\(s\) of the woken worker to the API server", log_text)
        for p in pods:
            assert await _identity(cluster, p) == before[p.name]
            await _pinned(env, p, n=1)
            assert p.kubelet.restarts == 0
    finally:
        for p in pods:
            await api.delete(R.WORKER_SNAPSHOTS, p.name, namespace=p.namespace)
