"""The node agent treats everything a worker controls as hostile (issue 18), against pods of the
local environment's sandboxes, one agent for their node (what moved to the real node, an unusable
``entrypoint.json`` and a node process forging the helper marker, is node/test_agent_trust.py):

- paths inside the container: a control directory that is a symlink to a node directory, and one
  reached through ``..``, are refused (``Accepted=False``, UnsafeContainerPath, the component named)
  also when a capture is asked, and the node directory is byte for byte what it was; a symlink
  planted at the name an agent used to write its state request through is never followed, and the
  capture and wake go on;
- markers a worker can forge: a process in the worker's own tree carrying ``DYNSNAP_OP=<the pod's
  UID>/criu`` changes nothing (no ``wait-helper``, nothing killed), while a dynsnap-cuda an earlier
  agent process left running past its bound is found through the agent's registry and killed.

Sandbox, why: its workers start with a control directory the pod author chose (a symlink made before
the entrypoint starts, a path through ``..``) or under a launcher forging the marker, and the agent,
one process of the test's, is killed and started again while its helper runs; on the real node the
helper goes with the agent's container.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from agentenv import (
    AGENT_NS,
    AGENT_SA,
    AgentProc,
    StubDriver,
    build_stub_driver,
    condition,
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
from refusalenv import observed, state_changes_since
from restart_faults import kill_agent, unhang
from trustenv import (
    control_dir,
    marked_in_pod,
    start_ticks,
    tree_bytes,
    with_control_dir,
    with_forged_helper,
)

from dynsnap.agent.helpers import REGISTRY_DIR
from dynsnap.k8s.client import Obj
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
    node_dirs: dict[str, Path] = field(default_factory=dict)  # pod component -> node dir it points at

    def pod(self, component: str) -> RunningPod:
        return self.graph.workers(component)[0]


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-trust-"))
    driver = build_stub_driver(work / "stubcuda")
    nodes = {"symlinked": work / "node" / "symlinked", "dotdot": work / "node" / "dotdot"}
    for d in nodes.values():
        d.mkdir(parents=True)
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")

    def comp(name: str) -> Obj:
        return worker_component(name, replicas=1, driver=driver)
    ctl = P.ENTRYPOINT_CONTROL_DIR
    g = await deploy_serving(cluster, D.dgd("trs", [
        D.frontend_component(),
        with_forged_helper(comp("worker")),  # the worker that is captured and woken
        with_control_dir(comp("symlinked"), f"{ctl}/ctl", symlink_to=nodes["symlinked"]),
        with_control_dir(comp("dotdot"), f"{ctl}/../..{nodes['dotdot']}"),
    ]))
    agent = AgentProc(g.workers("worker")[0].node, kubeconfig, work / "agent", driver,
                      extra=["--failure-backoff", "1", "--failure-backoff-max", "4",
                             "--helper-timeout", str(HELPER_BOUND_S), "--criu-timeout", str(HELPER_BOUND_S)])
    fe = D.FrontendClient(g.frontend)
    try:
        assert {p.node for ps in g.pods.values() for p in ps} == {agent.node}, "one node, one agent"
        await agent.start()
        await fe.wait_model()
        ids = {c: await D.instance_id(cluster, g.workers(c)[0]) for c in ("worker", "symlinked", "dotdot")}
        yield Env(g, fe, agent, driver, work, ids, nodes)
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


async def _refused(cluster: LocalCluster, env: Env, pod: RunningPod, reason: str, says: str) -> Obj:
    """A WorkerSnapshot for ``pod`` refused for ``reason``, and still refused once the worker is out of
    serving and asked to sleep (only the refusal stands between the spec and a capture)."""
    api = cluster.api
    created = await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    ws = await wait_ws(api, pod, "refused", observed(created["metadata"]["generation"]), agents=[env.agent])
    accepted = condition(ws, "Accepted")
    assert accepted is not None and (accepted["status"], accepted["reason"]) == ("False", reason), accepted
    assert says in accepted["message"], accepted["message"]
    await quiesce(cluster, pod, serving=False)
    patched = await api.merge_patch(R.WORKER_SNAPSHOTS, pod.name, {"spec": {"desiredState": "Suspended"}},
                                    namespace=pod.namespace)
    ws = await wait_ws(api, pod, "Suspended refused", observed(patched["metadata"]["generation"]), agents=[env.agent])
    accepted = condition(ws, "Accepted")
    assert accepted is not None and (accepted["status"], accepted["reason"]) == ("False", reason), accepted
    assert "lastCapture" not in ws["status"] and "lastError" not in ws["status"], ws["status"]
    return ws


async def _release(cluster: LocalCluster, pod: RunningPod) -> None:
    with contextlib.suppress(NotFound):
        await cluster.api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
    await quiesce(cluster, pod, serving=True)


def _ep_state(path: Path) -> str:
    return str(json.loads((path / P.ENTRYPOINT_CONTROL_FILE).read_text())["state"])


# -- paths inside the container -------------------------------------------------------------------

@pytest.mark.parametrize(("component", "says"), [
    ("symlinked", "/run/dynsnap/ctl is a symlink"),
    ("dotdot", "it has a '..' component"),
], ids=["symlinked", "dotdot"])
async def test_a_control_directory_leading_to_a_node_directory_is_refused_and_that_directory_untouched(
        cluster: LocalCluster, env: Env, component: str, says: str) -> None:
    pod, node_dir = env.pod(component), env.node_dirs[component]
    before = tree_bytes(node_dir)
    assert P.ENTRYPOINT_CONTROL_FILE in before, "the entrypoint keeps its control file in the node directory"
    mark = len(env.driver.calls())
    try:
        await _refused(cluster, env, pod, P.Reason.UNSAFE_CONTAINER_PATH.value, says)
        assert tree_bytes(node_dir) == before, "the agent wrote into the node directory"
        assert P.ENTRYPOINT_REQUEST_FILE not in os.listdir(node_dir)
        assert state_changes_since(env.driver, mark) == []
        assert _ep_state(node_dir) == "active"
    finally:
        await _release(cluster, pod)
    await _pinned(env, component)  # the worker serves on, untouched


async def _cycle(cluster: LocalCluster, env: Env, pod: RunningPod) -> tuple[Obj, Obj]:
    """Capture (tier suspend) and wake ``pod``, back in serving and answering: (asleep, awake)."""
    api = cluster.api
    await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=[env.agent])
    await quiesce(cluster, pod, serving=False)
    await set_desired(api, pod, "Suspended")
    asleep = await wait_ws(api, pod, "Suspended", state_is("Suspended", suspended=True), agents=[env.agent])
    await set_desired(api, pod, "Active")
    awake = await wait_ws(api, pod, "Active", lambda ws: state_is("Active", suspended=False)(ws) and bool(
        (ws["status"].get("lastWake") or {}).get("finished")), agents=[env.agent])
    await quiesce(cluster, pod, serving=True)
    await _pinned(env, "worker")
    return asleep, awake


def _steps(ws: Obj, record: str) -> list[str]:
    return [s["name"] for s in ws["status"][record]["steps"]]


async def test_a_symlink_planted_at_the_agents_former_temp_name_is_never_followed(cluster: LocalCluster,
                                                                                   env: Env) -> None:
    pod = env.pod("worker")
    assert env.agent.proc is not None
    victim = env.work / "node" / "victim"
    victim.write_bytes(b"a file of the node\n")
    ctl = control_dir(pod)
    planted = ctl / f".{P.ENTRYPOINT_REQUEST_FILE}.{env.agent.proc.pid}"  # where an agent wrote it before
    planted.symlink_to(victim)
    await cluster.api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    try:
        asleep, awake = await _cycle(cluster, env, pod)
        assert asleep["status"]["lastCapture"]["ok"] is True and awake["status"]["lastWake"]["ok"] is True
        assert victim.read_bytes() == b"a file of the node\n", "the agent wrote through the planted symlink"
        assert os.readlink(planted) == str(victim)
        left = sorted(os.listdir(ctl))
        assert left == sorted([P.ENTRYPOINT_CONTROL_FILE, P.ENTRYPOINT_REQUEST_FILE, planted.name, "worker.log"]), \
            f"the agent's temp files are gone, nothing else appeared: {left}"
    finally:
        planted.unlink(missing_ok=True)
        await _release(cluster, pod)


# -- markers any process can forge ------------------------------------------------------------------

async def test_a_forged_helper_marker_changes_nothing(cluster: LocalCluster, env: Env) -> None:
    pod = env.pod("worker")
    in_pod = marked_in_pod(pod)
    assert len(in_pod) == 1, f"the worker's own forged helper runs in its tree: {in_pod}"
    forged = {pid: start_ticks(pid) for pid in in_pod}
    await cluster.api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    try:
        asleep, awake = await _cycle(cluster, env, pod)
        # no wait for a "helper", no HelperTimeout for it: the agent did not take either for one
        assert _steps(asleep, "lastCapture") == ["quiesce", "save", "settle-suspended"], asleep["status"]
        assert _steps(awake, "lastWake") == ["wake", "resume", "settle-active"], awake["status"]
        assert {pid: start_ticks(pid) for pid in forged} == forged, "a forged process was killed"
    finally:
        await _release(cluster, pod)


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

