"""The node agent treats everything a worker controls as hostile (issue 18), against a pod of the local
environment's sandboxes and one agent for their node: a dynsnap-cuda an earlier agent process left running
past its bound is found through the agent's registry and killed, while a process in the worker's own tree
carrying ``DYNSNAP_OP=<the pod's UID>/criu`` (what agents before issue 18 took for their helper) is not.

Everything else of the suite runs on the real node: an unusable ``entrypoint.json`` and a node process
forging the marker in node/test_agent_trust.py; a control directory that is a symlink to a node directory
or reached through ``..``, a symlink planted at an agent's former temp name and the marker forged inside
the worker's tree in node/test_agent_refusals.py.

Sandbox, why: the agent, one process of the test's, is killed and started again while its helper runs; on
the real node the helper goes with the agent's container (node/test_agent_restart.py kills the node's
agent process with its helper; test_real_node_faults.py deletes the agent's pod).
"""

from __future__ import annotations

import contextlib
import json
import shutil
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
    build_stub_driver,
    deploy_serving,
    eventually,
    install_dynsnap,
    quiesce,
    set_desired,
    state_is,
    token_kubeconfig,
    wait_ws,
    worker_component,
    ws_body,
)
from helperprocs import helpers_of
from restart_faults import kill_agent, unhang
from trustenv import marked_in_pod, start_ticks, with_forged_helper

from dynsnap.agent.helpers import REGISTRY_DIR
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod

pytestmark = pytest.mark.cluster

# The agent's bound on a helper; a restarted agent kills one an earlier agent left running past it.
HELPER_BOUND_S = 20
HANG_MS = 120_000  # a save held this long outlives that bound


@dataclass
class Env:
    graph: D.Graph
    fe: D.FrontendClient
    agent: AgentProc
    driver: StubDriver
    work: Path
    ids: dict[str, int]

    def pod(self, component: str) -> RunningPod:
        return self.graph.workers(component)[0]


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-trust-"))
    driver = build_stub_driver(work / "stubcuda")
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    g = await deploy_serving(cluster, D.dgd("trs", [
        D.frontend_component(),
        with_forged_helper(worker_component("worker", replicas=1, driver=driver)),  # captured and woken
    ]))
    agent = AgentProc(g.workers("worker")[0].node, kubeconfig, work / "agent", driver,
                      extra=["--failure-backoff", "1", "--failure-backoff-max", "4",
                             "--helper-timeout", str(HELPER_BOUND_S), "--criu-timeout", str(HELPER_BOUND_S)])
    fe = D.FrontendClient(g.frontend)
    try:
        await agent.start()
        await fe.wait_model()
        ids = {"worker": await D.instance_id(cluster, g.workers("worker")[0])}
        yield Env(g, fe, agent, driver, work, ids)
    finally:
        await fe.close()
        await agent.stop()
        await D.teardown(cluster, g)
        shutil.rmtree(work, ignore_errors=True)


async def _pinned(env: Env, component: str) -> None:
    wid = env.ids[component]
    await env.fe.wait_routable(wid)
    res = await env.fe.chat(f"to {component}", worker_id=wid)
    assert res.status == 200 and res.worker_id == wid, res.body


async def _release(cluster: LocalCluster, pod: RunningPod) -> None:
    with contextlib.suppress(NotFound):
        await cluster.api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
    await quiesce(cluster, pod, serving=True)


# -- a helper an earlier agent left ------------------------------------------------------------------

async def test_a_helper_an_earlier_agent_left_past_its_bound_is_killed_through_the_registry(
        cluster: LocalCluster, env: Env) -> None:
    api, pod = cluster.api, env.pod("worker")
    forged = {pid: start_ticks(pid) for pid in marked_in_pod(pod)}
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    try:
        await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=[env.agent])
        await quiesce(cluster, pod, serving=False)
        env.driver.control(f"hang cuCheckpointProcessCheckpoint * {HANG_MS}")
        await set_desired(api, pod, "Suspended")

        async def saving() -> list[int] | None:
            pids = [h.pid for h in helpers_of(pod) if h.op == "save"]
            return pids or None
        save = await eventually("the save's dynsnap-cuda running", saving, timeout=60)

        async def recorded() -> bool:
            # What the test is about is a helper the earlier agent left on record: it is killed only once
            # the registry holds it (a record is written right after the exec; killed before that, the
            # agent leaves one the next cannot know, and that one starts a save of its own).
            records = (env.agent.state_dir / REGISTRY_DIR).glob("*.json")
            return any(json.loads(r.read_text()).get("pid") in save for r in records)
        await eventually("the save's dynsnap-cuda on the agent's registry", recorded, timeout=30)
        await kill_agent(env.agent)
        await env.agent.start()  # finds the save through the registry, waits, then kills it past its bound
        ws = await wait_ws(api, pod, "HelperTimeout", lambda ws: ((ws.get("status") or {}).get("lastError") or {})
                           .get("reason") == P.Reason.HELPER_TIMEOUT.value, timeout=HELPER_BOUND_S + 90,
                           agents=[env.agent])
        err = ws["status"]["lastError"]
        assert err["step"] == "wait-helper" and f"past its {HELPER_BOUND_S} s bound; killed" in err["message"], err
        assert f"{pod.uid}/save" in err["message"], err
        assert not [h for h in helpers_of(pod) if h.pid in save], "the helper was killed"
        assert {pid: start_ticks(pid) for pid in forged} == forged, "only the recorded helper was signalled"
        unhang(env.driver)
        await set_desired(api, pod, "Active")
        await wait_ws(api, pod, "rolled back, Active", state_is("Active", suspended=False), agents=[env.agent])
        await quiesce(cluster, pod, serving=True)
        await _pinned(env, "worker")
    finally:
        env.driver.clear_faults()
        if env.agent.proc is None:
            await env.agent.start()
        await _release(cluster, pod)

