"""Malformed input the API server rejects, and the node agent's refusals that need a worker made for
them (what moved to the real node, the specs naming the wrong pod and the serving and in-flight
guards and the idle facts, is node/test_agent_refusals.py).

- The API server rejects a malformed WorkerSnapshot (422, the field named) before any agent reads
  it, and keeps ``spec.podUID`` immutable.
- Two GPU processes mapping NCCL without the settings the driver needs to restore them: refused
  before any lock; with the settings, the same worker is captured and woken.

Sandbox, why: the NCCL workers start a second GPU process under a launcher and map fake_nccl, a
library of the test's, which the project's images do not carry. (The API server's validation needs no
node at all.)
"""

from __future__ import annotations

import contextlib
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
    StubDriver,
    build_stub_driver,
    deploy_serving,
    gather_stop,
    install_dynsnap,
    quiesce,
    set_desired,
    state_is,
    token_kubeconfig,
    wait_ws,
    ws_body,
)
from refusalenv import (
    NCCL_SAFE,
    build_fake_nccl,
    condition,
    entrypoint_info,
    hostile_ws,
    image_files,
    maps,
    pod_processes,
    refused_or_capturing,
    state_changes_since,
    stub_key,
    with_second_gpu_process,
)

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import Invalid, NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, LocalCluster, RunningPod

pytestmark = pytest.mark.cluster



@dataclass
class Env:
    graph: D.Graph
    fe: D.FrontendClient
    agents: list[AgentProc]
    driver: StubDriver
    ids: dict[str, int]  # pod name -> instance id

    def pod(self, component: str, i: int = 0) -> RunningPod:
        return self.graph.workers(component)[i]


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster) -> AsyncIterator[Env]:
    work = Path(tempfile.mkdtemp(prefix="dynsnap-refusals-"))
    driver = build_stub_driver(work / "stubcuda")
    nccl = build_fake_nccl(work / "fakenccl")
    await install_dynsnap(cluster)
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    ranks = {"LD_PRELOAD": f"{driver.libcuda} {nccl}"}
    g = await deploy_serving(cluster, D.dgd("rfs", [
        D.frontend_component(),
        # two GPU processes mapping NCCL, without and with the settings the driver needs
        with_second_gpu_process(D.mocker_component("ranks", replicas=1, dynsnap=True, env=ranks)),
        with_second_gpu_process(D.mocker_component("safe-ranks", replicas=1, dynsnap=True,
                                                   env={**ranks, **NCCL_SAFE})),
    ]))
    backoff = ["--failure-backoff", "1", "--failure-backoff-max", "4", "--scrape-interval", "1"]
    agents = [AgentProc(node, kubeconfig, work / node, driver, extra=backoff) for node in NODES]
    fe = D.FrontendClient(g.frontend)
    try:
        for a in agents:
            await a.start()
        await fe.wait_model()
        workers = [p for name, ps in g.pods.items() if name != "Frontend" for p in ps]
        ids = {p.name: await D.instance_id(cluster, p) for p in workers}
        for wid in ids.values():
            await fe.wait_routable(wid, timeout=120)
        yield Env(g, fe, agents, driver, ids)
    finally:
        await fe.close()
        await gather_stop(agents)
        await D.teardown(cluster, g)


async def _pinned(env: Env, pod: RunningPod, n: int = 1) -> None:
    """n requests pinned to the worker through the frontend, each answered by it."""
    wid = env.ids[pod.name]
    await env.fe.wait_routable(wid)
    for i in range(n):
        res = await env.fe.chat(f"pinned {i}", worker_id=wid)
        assert res.status == 200 and res.worker_id == wid, res.body


async def _release(cluster: LocalCluster, env: Env, pod: RunningPod) -> None:
    """End of a test on ``pod``: whatever an assertion left behind, the worker is woken and back in
    serving (bounded) and its WorkerSnapshot deleted, so the next test starts from an active worker."""
    api = cluster.api
    with contextlib.suppress(Exception):
        await set_desired(api, pod, "Active")
        await wait_ws(api, pod, "Active (cleanup)", state_is("Active"), timeout=60, agents=env.agents)
    with contextlib.suppress(NotFound):
        await api.delete(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
    await quiesce(cluster, pod, serving=True)


def _untouched(env: Env, pods: list[RunningPod], mark: int) -> None:
    """Nothing was captured: each worker's processes run (under an active entrypoint where it has
    one), the stub driver has every process running and saw no state change since ``mark``, no image
    or staging directory exists on any node."""
    for pod in pods:
        assert pod.sandbox.alive() and len(pod_processes(pod)) >= 1, f"{pod.name}: its processes are gone"
        if os.readlink(f"/proc/{pod.sandbox.pid}/exe").endswith("/dynsnap-entrypoint"):
            info = entrypoint_info(pod)
            assert info["state"] == P.EntrypointState.ACTIVE.value and info["worker_alive"] is True, info
    assert set(env.driver.states().values()) <= {0}, f"stub driver states: {env.driver.states()}"
    assert state_changes_since(env.driver, mark) == []
    assert image_files(env.agents) == []


# -- 1. the API server ----------------------------------------------------------------------------

VALID_UID = "0a1b2c3d-0000-4000-8000-00000000abcd"


def _valid(name: str) -> Obj:
    return hostile_ws(name=name, namespace=TEST_NAMESPACE, node=NODES[0], pod_name=name, pod_uid=VALID_UID,
                      tier="suspend")


MALFORMED = [  # (id, spec fields changed from a valid body, the field the error names, what it says)
    ("pod-name-parent-path", {"podName": "../x"}, "spec.podName", "should match"),
    ("pod-name-with-slash", {"podName": "a/b"}, "spec.podName", "should match"),
    ("name-is-not-the-pod-name", {"podName": "rfs-val-another"}, "spec.podName",
     "metadata.name must equal spec.podName"),
    ("malformed-pod-uid", {"podUID": "0a1b2c3d-0000-4000-8000-XYZ"}, "spec.podUID", "should match"),
    ("unknown-tier", {"tier": "hibernate"}, "spec.tier", "Unsupported value"),
    ("unknown-desired-state", {"desiredState": "Asleep"}, "spec.desiredState", "Unsupported value"),
    ("upper-case-container", {"container": "Main"}, "spec.container", "should match"),
]


async def test_api_server_rejects_malformed_worker_snapshots(cluster: LocalCluster) -> None:
    api = cluster.api
    await install_dynsnap(cluster)
    # The valid body the malformed ones are made from is accepted: each rejection is its one change.
    ok = await api.create(R.WORKER_SNAPSHOTS, _valid("rfs-val-ok"))
    assert ok["spec"]["podName"] == "rfs-val-ok"
    try:
        for case, change, field, says in MALFORMED:
            name = f"rfs-val-{case}"
            body = _valid(name)
            body["spec"].update(change)
            with pytest.raises(Invalid) as caught:
                await api.create(R.WORKER_SNAPSHOTS, body)
            err = caught.value
            causes = err.details.get("causes") or []
            assert err.status == 422, case
            assert any(c.get("field") == field and says in c.get("message", "") for c in causes), \
                f"{case}: {err.message} / {causes}"
            with pytest.raises(NotFound):
                await api.get(R.WORKER_SNAPSHOTS, name, namespace=TEST_NAMESPACE)
        # podUID is immutable: the update is refused and the object keeps its UID.
        with pytest.raises(Invalid) as caught:
            await api.merge_patch(R.WORKER_SNAPSHOTS, "rfs-val-ok",
                                  {"spec": {"podUID": "0a1b2c3d-0000-4000-8000-00000000ffff"}},
                                  namespace=TEST_NAMESPACE)
        assert caught.value.status == 422
        assert any(c.get("field") == "spec.podUID" for c in caught.value.details.get("causes") or [])
        assert "podUID is immutable" in caught.value.message
        live = await api.get(R.WORKER_SNAPSHOTS, "rfs-val-ok", namespace=TEST_NAMESPACE)
        assert live["spec"]["podUID"] == VALID_UID
        names = {w["metadata"]["name"] for w in (await api.list(R.WORKER_SNAPSHOTS, namespace=TEST_NAMESPACE))
                 ["items"]}
        assert names & {f"rfs-val-{c[0]}" for c in MALFORMED} == set()
    finally:
        await api.delete(R.WORKER_SNAPSHOTS, "rfs-val-ok", namespace=TEST_NAMESPACE)


# -- 4. several GPU processes on NCCL --------------------------------------------------------------

def _ranks(pod: RunningPod) -> list[tuple[int, dict[str, str]]]:
    """The pod's processes that map both the (stub) CUDA driver and libnccl.so.2."""
    return [(pid, st) for pid, st in pod_processes(pod).items() if {"libcuda.so.1", "libnccl.so.2"} <= maps(pid)]


def _two_ranks_in_the_worker_tree(pod: RunningPod) -> list[int]:
    """The worker's root process and its child both map the driver and NCCL (precondition)."""
    ranks = _ranks(pod)
    root = pod.sandbox.host_pid(int(entrypoint_info(pod)["worker_pid"]))
    assert root is not None and len(ranks) == 2, ranks
    pids = {pid for pid, _ in ranks}
    assert root in pids, "the mocker (the worker's root) is one of the GPU processes"
    child = next(st for pid, st in ranks if pid != root)
    assert int(child["PPid"]) == root, "the second GPU process is the worker's child"
    return sorted(pids)


async def test_ranks_on_nccl_without_the_settings_the_driver_needs_are_refused_before_any_lock(
        cluster: LocalCluster, env: Env) -> None:
    api = cluster.api
    pod = env.pod("ranks")
    _two_ranks_in_the_worker_tree(pod)
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    try:
        await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=env.agents)
        mark = len(env.driver.calls())
        await quiesce(cluster, pod, serving=False)
        await set_desired(api, pod, "Suspended")
        ws = await wait_ws(api, pod, "refused: UnsafeMultiGpu", refused_or_capturing(P.Reason.UNSAFE_MULTI_GPU.value),
                           agents=env.agents)
        err = ws["status"].get("lastError") or {}
        assert err.get("reason") == P.Reason.UNSAFE_MULTI_GPU.value, ws["status"]
        assert err["step"] == "quiesce"
        assert "2 GPU processes use NCCL" in err["message"], err
        for k, v in NCCL_SAFE.items():
            assert f"{k}=(unset)" in err["message"] and f"{k}={v}" in err["message"], err["message"]
        assert condition(ws, "Degraded")["reason"] == P.Reason.UNSAFE_MULTI_GPU.value
        calls = env.driver.calls()[mark:]
        assert not [c for c in calls if c.startswith("cuCheckpointProcessLock")], calls
        _untouched(env, [pod], mark)
        await set_desired(api, pod, "Active")
        await quiesce(cluster, pod, serving=True)
        await _pinned(env, pod)
        _untouched(env, [pod], mark)
    finally:
        await _release(cluster, env, pod)


async def test_ranks_on_nccl_with_the_settings_are_captured_and_woken(cluster: LocalCluster, env: Env) -> None:
    api = cluster.api
    pod = env.pod("safe-ranks")
    ranks = _two_ranks_in_the_worker_tree(pod)
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    try:
        await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=env.agents)
        mark = len(env.driver.calls())
        await quiesce(cluster, pod, serving=False)
        await set_desired(api, pod, "Suspended")
        asleep = await wait_ws(api, pod, "Suspended", state_is("Suspended", suspended=True), agents=env.agents)
        cap = asleep["status"]["lastCapture"]
        assert cap["ok"] is True and [s["name"] for s in cap["steps"]] == ["quiesce", "save", "settle-suspended"]
        assert sorted(p["host"] for p in cap["pids"] if p["gpu"]) == ranks
        checkpointed = {int(c.split("pid=")[1].split()[0]) for c in env.driver.calls()[mark:]
                        if c.startswith("cuCheckpointProcessCheckpoint ") and c.endswith(" rc=0")}
        assert checkpointed == set(ranks), "both ranks were checkpointed, by the one save"
        states = env.driver.states()
        assert [states.get(stub_key(pid)) for pid in ranks] == [2, 2], states  # 2: checkpointed
        await set_desired(api, pod, "Active")
        awake = await wait_ws(api, pod, "Active", state_is("Active", suspended=False), agents=env.agents)
        wake = awake["status"]["lastWake"]
        assert wake["ok"] is True and [s["name"] for s in wake["steps"]] == ["wake", "resume", "settle-active"]
        assert set(env.driver.states().values()) <= {0}
        await quiesce(cluster, pod, serving=True)
        await _pinned(env, pod)
        assert _two_ranks_in_the_worker_tree(pod) == ranks, "the same two processes, woken in place"
    finally:
        await _release(cluster, env, pod)
