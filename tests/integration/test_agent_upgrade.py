"""A rolling upgrade of the agent while a worker sleeps, across a capture format bump: the new agent
wakes the worker from the capture its predecessor wrote (issue 18: a format bump sent every
snapshotted worker to a cold restart, its capture "never reused"), and its own captures carry its
format.

The next release's agent is ``fake_next_agent`` (tests/integration/fake_next_agent/): this checkout's
agent with its capture format one newer and this one's still read, as that release's
``IMAGE_FORMATS_READ`` would say. The worker is a live mocker under dynsnap-entrypoint in a pod
sandbox; after the wake it is the same worker (its container never restarted, the same pod UID and
IP) and a request pinned to it is answered by it.

Sandbox, why: the next release's agent is fake_next_agent, a process; on the real node it would be a
second agent image, not built here (the chart's own agent upgrade under a sleeping worker is
node/test_long_sleep.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agentenv import (
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    build_stub_driver,
    deploy_serving,
    install_dynsnap,
    quiesce,
    set_desired,
    state_is,
    token_kubeconfig,
    wait_ws,
    worker_component,
    ws_body,
)
from faultsenv import ep_info, restart_agent

from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, LocalCluster, RunningPod

pytestmark = pytest.mark.cluster

NEXT_AGENT = Path(__file__).resolve().parent / "fake_next_agent"
NEXT_FORMAT = P.IMAGE_FORMAT + 1


@dataclass
class Env:
    cluster: LocalCluster
    graph: D.Graph
    fe: D.FrontendClient
    agent: AgentProc
    wid: int

    @property
    def pod(self) -> RunningPod:
        return self.graph.workers("upgraded")[0]


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-upgrade-"))
    driver = build_stub_driver(work / "stubcuda")
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    g = await deploy_serving(cluster, D.dgd("upg", [D.frontend_component(),
                                                    worker_component("upgraded", replicas=1, driver=driver)]))
    agent = AgentProc(NODES[0], kubeconfig, work / NODES[0], driver)
    fe = D.FrontendClient(g.frontend)
    try:
        await agent.start()
        await fe.wait_model()
        pod = g.workers("upgraded")[0]
        wid = await D.instance_id(cluster, pod)
        await fe.wait_routable(wid)
        yield Env(cluster, g, fe, agent, wid)
    finally:
        await fe.close()
        await agent.stop()
        await D.teardown(cluster, g)


def _as_next_release(agent: AgentProc) -> None:
    path = [str(NEXT_AGENT), *filter(None, [os.environ.get("PYTHONPATH")])]
    agent.env = {"PYTHONPATH": os.pathsep.join(path), "DYNSNAP_FAKE_NEXT_IMAGE_FORMAT": str(NEXT_FORMAT)}


def _manifest(ws: dict) -> dict:
    return json.loads((Path(ws["status"]["image"]["path"]) / P.MANIFEST_FILE).read_text())


async def _capture(env: Env) -> dict:
    await quiesce(env.cluster, env.pod, serving=False)
    await set_desired(env.cluster.api, env.pod, "Suspended")
    ws: dict = await wait_ws(env.cluster.api, env.pod, "Suspended", state_is("Suspended", suspended=True),
                             agents=[env.agent])
    return ws


async def _wake_and_serve(env: Env) -> dict:
    await set_desired(env.cluster.api, env.pod, "Active")
    ws: dict = await wait_ws(env.cluster.api, env.pod, "Active", state_is("Active", suspended=False),
                             agents=[env.agent], timeout=120)
    await quiesce(env.cluster, env.pod, serving=True)
    await env.fe.wait_routable(env.wid)
    for i in range(2):
        res = await env.fe.chat(f"after the upgrade {i}", worker_id=env.wid)
        assert res.status == 200 and res.worker_id == env.wid, res.body
    return ws


async def test_the_next_agent_wakes_a_worker_its_predecessor_snapshotted(env: Env) -> None:
    pod = env.pod
    before = await env.cluster.api.get(R.PODS, pod.name, namespace=pod.namespace)
    started = ep_info(pod)["started"]
    await env.cluster.api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="snapshot"))
    await wait_ws(env.cluster.api, pod, "Accepted, Active", state_is("Active"), agents=[env.agent])
    asleep = await _capture(env)
    assert _manifest(asleep)["format"] == P.IMAGE_FORMAT

    # The DaemonSet rolls: the old agent goes, the next release's comes, the worker asleep meanwhile.
    _as_next_release(env.agent)
    await restart_agent(env.agent, env.agent.extra)
    ws = await wait_ws(env.cluster.api, pod, "still asleep under the next agent",
                       state_is("Suspended", suspended=True), agents=[env.agent])
    assert ws["status"]["image"]["path"] == asleep["status"]["image"]["path"]

    woken = await _wake_and_serve(env)
    assert woken["status"]["lastWake"]["ok"] is True and woken["status"].get("lastError") is None, woken["status"]
    assert ep_info(pod)["started"] == started, "the container restarted: the worker was not woken in place"
    after = await env.cluster.api.get(R.PODS, pod.name, namespace=pod.namespace)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["status"]["podIP"] == before["status"]["podIP"]

    # The next agent's own capture carries its format, and it wakes from that too.
    again = await _capture(env)
    assert _manifest(again)["format"] == NEXT_FORMAT
    await _wake_and_serve(env)
    assert ep_info(pod)["started"] == started
