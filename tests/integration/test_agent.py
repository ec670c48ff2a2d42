"""The node agent takes a live Dynamo mocker worker through each tier and back with no other action
than setting ``desiredState``: the agent runs as its own process under its shipped RBAC (a token
from the TokenRequest API), finds the worker through the pod UID in /proc and its entrypoint's
control directory through /proc/<pid>/root, and after every wake the worker is the same worker:
same pod UID, IP, DWM UID and instance id, its EndpointSlice endpoint ready again with the same
targetRef.uid, the same TCP connections, and a request pinned to it is answered by it."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
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

from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, RunningPod, wait_for

pytestmark = pytest.mark.cluster


@dataclass
class Env:
    graph: D.Graph
    fe: D.FrontendClient
    agents: list[AgentProc]
    driver: StubDriver
    ids: dict[str, int]


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-agent-"))
    driver = build_stub_driver(work / "stubcuda")
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    g = await deploy_serving(cluster, D.dgd("agt", [D.frontend_component(),
                                                    worker_component("worker", replicas=2, driver=driver)]))
    agents = [AgentProc(node, kubeconfig, work / node, driver) for node in NODES]
    fe = D.FrontendClient(g.frontend)
    try:
        for a in agents:
            await a.start()
        await fe.wait_model()
        ids = {p.name: await D.instance_id(cluster, p) for p in g.workers("worker")}
        for wid in ids.values():
            await fe.wait_routable(wid)
        yield Env(g, fe, agents, driver, ids)
    finally:
        await fe.close()
        await gather_stop(agents)
        await D.teardown(cluster, g)


async def _identity(cluster: LocalCluster, pod: RunningPod) -> dict[str, object]:
    p = await cluster.api.get(R.PODS, pod.name, namespace=pod.namespace)
    dwm = await cluster.api.get(R.DWMS, pod.name, namespace=pod.namespace)
    return {"uid": p["metadata"]["uid"], "ip": p["status"]["podIP"], "dwm": dwm["metadata"]["uid"],
            "instance": instance_id_from_dwm(dwm)}


async def _endpoint_ready(cluster: LocalCluster, pod: RunningPod) -> bool:
    ep = await cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")
    return bool(ep and ep.get("conditions", {}).get("ready") and ep["targetRef"]["uid"] == pod.uid)


async def _endpoint_becomes(cluster: LocalCluster, pod: RunningPod, ready: bool) -> bool:
    """Whether the worker's EndpointSlice endpoint reaches ``ready`` within 30 s. The pod's Ready
    condition comes first; the EndpointSlice controller follows it a moment later (a check right
    after the pod turned Ready read the old endpoint under load, once in CI)."""
    async def reached() -> bool:
        return await _endpoint_ready(cluster, pod) == ready
    try:
        return bool(await wait_for(f"the endpoint ready={ready}", reached, timeout=30, interval=0.2))
    except TimeoutError:
        return False


async def _cycle(cluster: LocalCluster, env: Env, pod: RunningPod, tier: str) -> dict[str, object]:
    """Quiesce, Suspended, Active, back in serving; returns the asleep WorkerSnapshot."""
    api = cluster.api
    await quiesce(cluster, pod, serving=False)
    await set_desired(api, pod, "Suspended")
    asleep = await wait_ws(api, pod, "Suspended", state_is("Suspended", suspended=True), agents=env.agents)
    await set_desired(api, pod, "Active")
    await wait_ws(api, pod, "Active again", state_is("Active", suspended=False), agents=env.agents)
    await quiesce(cluster, pod, serving=True)
    return asleep


async def _pinned(env: Env, pod: RunningPod, n: int = 2) -> list[str]:
    """n requests pinned to the worker, each answered by it; their request ids (the worker logs them)."""
    wid = env.ids[pod.name]
    await env.fe.wait_routable(wid)
    ids = []
    for i in range(n):
        res = await env.fe.chat(f"pinned {i}", worker_id=wid)
        assert res.status == 200 and res.worker_id == wid, res.body
        ids.append(str(res.body["id"]).removeprefix("chatcmpl-"))
    return ids


def _ppid(host_pid: int) -> int:
    status = Path(f"/proc/{host_pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


@pytest.mark.parametrize("tier", ["suspend", "snapshot"])
async def test_desired_state_takes_a_worker_through_each_tier_and_back(cluster: LocalCluster, env: Env,
                                                                        tier: str) -> None:
    api = cluster.api
    pod = env.graph.workers("worker")[0]
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier=tier))
    try:
        ws = await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=env.agents)
        assert condition(ws, "Accepted")["status"] == "True"
        before = await _identity(cluster, pod)
        before_ids = await _pinned(env, pod, n=1)
        conns = established(pod, remote=apiserver_addr(cluster))
        assert conns, "the worker holds TCP connections to the API server (its discovery watches)"
        await quiesce(cluster, pod, serving=False)
        assert await _endpoint_becomes(cluster, pod, ready=False)
        await set_desired(api, pod, "Suspended")
        asleep = await wait_ws(api, pod, "Suspended", state_is("Suspended", suspended=True), agents=env.agents)
        st = asleep["status"]
        cap = st["lastCapture"]
        assert cap["ok"] is True and cap["tier"] == tier
        names = [s["name"] for s in cap["steps"]]
        gpu_pids = [p for p in cap["pids"] if p["gpu"]]
        assert gpu_pids, "the worker maps the (stub) CUDA driver: the agent found it as a GPU process"
        assert all(p["ns"] >= P.PID_FLOOR for p in cap["pids"])
        ctl = json.loads((Path(f"/proc/{pod.sandbox.pid}/root") / "run/dynsnap/entrypoint.json").read_text())
        if tier == "suspend":
            assert names == ["quiesce", "save", "settle-suspended"]
            assert ctl["state"] == "suspended" and ctl["worker_alive"] is True
            assert set(env.driver.states().values()) >= {2}  # the stub driver: checkpointed
        else:
            assert names == ["quiesce", "save", "dump", "seal", "settle-snapshotted"]
            assert ctl["state"] == "snapshotted" and ctl["worker_alive"] is False
            image = Path(st["image"]["path"])
            assert st["image"]["format"] == P.IMAGE_FORMAT and image.is_dir()
            assert oct(image.stat().st_mode & 0o777) == "0o700"
            manifest = json.loads((image / P.MANIFEST_FILE).read_text())
            assert manifest["podUID"] == pod.uid
            assert {f"core-{p['ns']}.img" for p in gpu_pids} <= set(os.listdir(image))
        await set_desired(api, pod, "Active")
        awake = await wait_ws(api, pod, "Active", state_is("Active", suspended=False), agents=env.agents)
        wake = awake["status"]["lastWake"]
        assert wake["ok"] is True
        wnames = [s["name"] for s in wake["steps"]]
        assert wnames == (["wake", "resume", "settle-active"] if tier == "suspend"
                          else ["wake", "restore", "resume", "settle-active"])
        await quiesce(cluster, pod, serving=True)
        assert await _endpoint_becomes(cluster, pod, ready=True)
        assert await _identity(cluster, pod) == before
        assert conns <= established(pod, remote=apiserver_addr(cluster)), \
            "the worker's API-server connections are the same ones after the wake"
        after_ids = await _pinned(env, pod)
        assert pod.kubelet.restarts == 0
        # The worker's own log lines from before the sleep and after the wake reach the container's
        # stdout (the entrypoint copies the worker's log file): one worker, one log, no gap.
        async def logged() -> bool:
            text = re.sub(r"\x1b\[[0-9;]*m", "", pod.sandbox.log_path.read_text(errors="replace"))
            return all(f"request_id={rid}" in text for rid in before_ids + after_ids)
        await eventually("request ids from before and after the wake in the container log", logged, timeout=30)
        host = pod.sandbox.host_pid(ctl["worker_pid"])
        assert host is not None and _ppid(host) == pod.sandbox.pid, "the worker is the entrypoint's child again"
        # Every step explained: the agent's Events about this WorkerSnapshot (reported as dynsnap's agent).
        events = (await api.list(R.EVENTS, namespace=pod.namespace))["items"]
        mine = [(e["reason"], e.get("note", "")) for e in events
                if e["regarding"].get("uid") == awake["metadata"]["uid"]
                and e.get("reportingController") == "dynsnap.io/agent"]
        reasons = {r for r, _ in mine}
        assert {"Capturing", "Suspended", "Waking", "Active"} <= reasons, mine
        assert any(r == "Suspended" and n.startswith("captured in ") for r, n in mine), mine
        if tier == "snapshot":  # woken from and superseded: the images (the worker's secrets) are gone
            assert not Path(st["image"]["path"]).exists()
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)


async def test_twenty_consecutive_snapshot_cycles_of_one_worker(cluster: LocalCluster, env: Env) -> None:
    api = cluster.api
    pod = env.graph.workers("worker")[1]
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    try:
        await wait_ws(api, pod, "Active", state_is("Active"), agents=env.agents)
        before = await _identity(cluster, pod)
        captures = set()
        for _ in range(20):
            asleep = await _cycle(cluster, env, pod, "snapshot")
            captures.add(asleep["status"]["lastCapture"]["id"])
            assert await _identity(cluster, pod) == before
            await _pinned(env, pod, n=1)
        assert len(captures) == 20
        assert pod.kubelet.restarts == 0
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
