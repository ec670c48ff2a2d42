"""Hostile and malformed input changes nothing, and the node agent's refusals name their cause.

- The API server rejects a malformed WorkerSnapshot (422, the field named) before any agent reads
  it, and keeps ``spec.podUID`` immutable.
- Specs the API accepts but that name the wrong pod (another pod's UID, a pod of another namespace,
  a pod on another node), a pod that did not opt in, or one not under dynsnap-entrypoint are refused
  by the agent (``Accepted=False`` with the reason), also when ``Suspended`` is asked, and the worker
  keeps serving: entrypoint active, every stub-driver state running, no driver state change, no image
  on disk, a pinned request answered.
- The serving guard: a capture of a worker still in serving (its ``dynsnap.io/serving`` gate True, or
  requests in flight by its own metrics) is refused before any change, and proceeds once it is not.
- Two GPU processes mapping NCCL without the settings the driver needs to restore them: refused
  before any lock; with the settings, the same worker is captured and woken.
- Idle facts at the edge: ``status.idle`` follows the worker's own metrics, and a quiet worker's
  WorkerSnapshot is not rewritten.

Sandbox, why: it hands the agent WorkerSnapshots it writes itself, with no controller; on the real
node the chart's controller owns them (the controller-side refusals are
node/test_controller_refusals.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
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
    StreamedChat,
    build_fake_nccl,
    condition,
    connections_to,
    entrypoint_info,
    hostile_ws,
    image_files,
    maps,
    metric_names,
    metric_sum,
    observed,
    pod_processes,
    refused_or_capturing,
    state_changes_since,
    stream_chat,
    stub_key,
    wait_ws_at,
    with_second_gpu_process,
    worker_metrics,
)

from dynsnap.agent.idle import INFLIGHT, REQUESTS  # the series the agent reads: they must exist
from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import Conflict, Invalid, NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import NODES, TEST_NAMESPACE, LocalCluster, RunningPod

pytestmark = pytest.mark.cluster

OTHER_NS = "refusal-other"  # a namespace with no pods: a WorkerSnapshot there names none of them
# The workers' mocker speed: 1000 tokens take about 30 s, so a request stays in flight while the gate
# flips and the agent looks; a pinned 8-token request still takes well under a second.
SLOW = 0.2
LONG_TOKENS = 1000


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
    with contextlib.suppress(Conflict):
        await cluster.api.create(R.NAMESPACES, {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": OTHER_NS}})
    kubeconfig = await token_kubeconfig(cluster, namespace=AGENT_NS, sa=AGENT_SA, path=work / "agent.kubeconfig")
    cuda = {"LD_PRELOAD": str(driver.libcuda)}
    ranks = {"LD_PRELOAD": f"{driver.libcuda} {nccl}"}
    gate = {"readinessGates": [{"conditionType": P.CONDITION_SERVING}]}
    g = await deploy_serving(cluster, D.dgd("rfs", [
        D.frontend_component(),
        # opted in, under the entrypoint, one GPU process: worker-0 on node-a, worker-1 on node-b
        D.mocker_component("worker", replicas=2, dynsnap=True, env=cuda, speedup_ratio=SLOW),
        # a GPU worker that did not opt in (no readiness gate), not under the entrypoint either
        D.mocker_component("plain", replicas=1, env=cuda),
        # opted in (the gate) but run without dynsnap-entrypoint
        D.mocker_component("gated", replicas=1, env=cuda, extra_pod_spec=gate),
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
        with contextlib.suppress(NotFound):
            await cluster.api.delete(R.NAMESPACES, OTHER_NS)


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


# -- 2. specs the API accepts and the agent refuses ------------------------------------------------

@dataclass(frozen=True)
class Hostile:
    body: Obj
    targets: list[RunningPod]  # the pods it names (by name or UID): none of them may change
    reason: str
    message: str  # what the Accepted condition's message must say


def _hostile(env: Env, case: str) -> Hostile:
    w0, w1 = env.pod("worker", 0), env.pod("worker", 1)
    assert (w0.node, w1.node) == (NODES[0], NODES[1])
    if case == "uid-of-another-pod":
        # Acted on, it would capture worker-1: a pod's processes are found by UID in /proc (here every
        # fake node's pods share this host's /proc), whatever pod the name says.
        return Hostile(hostile_ws(name=w0.name, namespace=w0.namespace, node=w0.node, pod_name=w0.name,
                                  pod_uid=w1.uid), [w0, w1], P.Reason.POD_UID_MISMATCH.value,
                       f"pod {w0.name} has UID {w0.uid}, the spec names {w1.uid}")
    if case == "pod-of-another-namespace":
        return Hostile(hostile_ws(name=w0.name, namespace=OTHER_NS, node=w0.node, pod_name=w0.name,
                                  pod_uid=w0.uid), [w0], P.Reason.POD_NOT_FOUND.value,
                       f"pod {OTHER_NS}/{w0.name} does not exist")
    if case == "not-opted-in":
        plain = env.pod("plain")
        return Hostile(hostile_ws(name=plain.name, namespace=plain.namespace, node=plain.node, pod_name=plain.name,
                                  pod_uid=plain.uid), [plain], P.Reason.NOT_OPTED_IN.value,
                       f"pod has no readiness gate {P.CONDITION_SERVING}")
    if case == "not-under-entrypoint":
        gated = env.pod("gated")
        return Hostile(hostile_ws(name=gated.name, namespace=gated.namespace, node=gated.node, pod_name=gated.name,
                                  pod_uid=gated.uid), [gated], P.Reason.NOT_UNDER_ENTRYPOINT.value,
                       "no container runs dynsnap-entrypoint as its PID 1")
    assert case == "pod-on-another-node"
    # Labelled for node-a: node-a's agent refuses it; node-b's, which would accept it, never sees it (it
    # watches only WorkerSnapshots labelled with its node).
    return Hostile(hostile_ws(name=w1.name, namespace=w1.namespace, node=w0.node, pod_name=w1.name,
                              pod_uid=w1.uid), [w1], P.Reason.WRONG_NODE.value,
                   f"pod runs on {w1.node!r}, this agent serves {w0.node!r}")


@pytest.mark.parametrize("case", ["uid-of-another-pod", "pod-of-another-namespace", "not-opted-in",
                                  "not-under-entrypoint", "pod-on-another-node"])
async def test_agent_refuses_a_spec_naming_the_wrong_pod_and_changes_nothing(cluster: LocalCluster, env: Env,
                                                                             case: str) -> None:
    api = cluster.api
    h = _hostile(env, case)
    ns, name = h.body["metadata"]["namespace"], h.body["metadata"]["name"]
    mark = len(env.driver.calls())
    created = await api.create(R.WORKER_SNAPSHOTS, h.body)
    try:
        ws = await wait_ws_at(api, ns, name, "refused", observed(created["metadata"]["generation"]),
                              agents=env.agents)
        accepted = condition(ws, "Accepted")
        assert (accepted["status"], accepted["reason"]) == ("False", h.reason), accepted
        assert h.message in accepted["message"], accepted["message"]
        assert ws["status"]["state"] == P.ObservedState.UNKNOWN.value
        # Asked to sleep, with every pod it names out of serving, as the controller would leave them:
        # only the refusal stands between the spec and a capture (tier snapshot: it would leave images).
        # On a pod without the gate the condition changes nothing: the agent must go by the pod's spec.
        for pod in h.targets:
            await cluster.set_serving_gate(pod, False)
        for pod in h.targets:
            if await _gated(cluster, pod):
                await cluster.wait_ready(pod.namespace, pod.name, ready=False, timeout=60)
        patched = await api.merge_patch(R.WORKER_SNAPSHOTS, name, {"spec": {"desiredState": "Suspended"}},
                                        namespace=ns)
        ws = await wait_ws_at(api, ns, name, "Suspended refused", observed(patched["metadata"]["generation"]),
                              agents=env.agents)
        accepted = condition(ws, "Accepted")
        assert (accepted["status"], accepted["reason"]) == ("False", h.reason), accepted
        assert "lastCapture" not in ws["status"] and "lastError" not in ws["status"], ws["status"]
        _untouched(env, h.targets, mark)
    finally:
        with contextlib.suppress(NotFound):
            await api.delete(R.WORKER_SNAPSHOTS, name, namespace=ns)
        for pod in h.targets:
            await cluster.set_serving_gate(pod, True)
    for pod in h.targets:
        await cluster.wait_ready(pod.namespace, pod.name, timeout=60)
        await _pinned(env, pod)
    _untouched(env, h.targets, mark)


async def _gated(cluster: LocalCluster, pod: RunningPod) -> bool:
    live = await cluster.api.get(R.PODS, pod.name, namespace=pod.namespace)
    return any(g.get("conditionType") == P.CONDITION_SERVING for g in live["spec"].get("readinessGates") or [])


# -- 3. the serving guard ---------------------------------------------------------------------------

async def test_capture_of_a_worker_still_in_serving_is_refused_until_it_is_quiesced(cluster: LocalCluster,
                                                                                   env: Env) -> None:
    api = cluster.api
    pod = env.pod("worker", 0)
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    try:
        ws = await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=env.agents)
        assert condition(ws, "Accepted")["status"] == "True"
        mark = len(env.driver.calls())
        await set_desired(api, pod, "Suspended")  # nobody quiesced it: its gate is still True
        ws = await wait_ws(api, pod, "refused: WorkerServing", refused_or_capturing(P.Reason.WORKER_SERVING.value),
                           agents=env.agents)
        err = ws["status"].get("lastError") or {}
        assert err.get("reason") == P.Reason.WORKER_SERVING.value, ws["status"]
        assert err["step"] == "quiesce"
        assert f"the pod's {P.CONDITION_SERVING} condition is True, not False" in err["message"], err
        degraded = condition(ws, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", P.Reason.WORKER_SERVING.value)
        assert P.CONDITION_SERVING in degraded["message"]
        cap = ws["status"]["lastCapture"]
        assert cap["ok"] is False and cap["error"]["reason"] == P.Reason.WORKER_SERVING.value
        # Refused before any change: it still serves, on the GPU, under an active entrypoint.
        await _pinned(env, pod, n=2)
        _untouched(env, [pod], mark)
        await quiesce(cluster, pod, serving=False)
        asleep = await wait_ws(api, pod, "Suspended once quiesced", state_is("Suspended", suspended=True),
                               agents=env.agents)
        st = asleep["status"]
        assert st["lastCapture"]["ok"] is True
        assert [s["name"] for s in st["lastCapture"]["steps"]] == ["quiesce", "save", "settle-suspended"]
        assert (condition(asleep, "Degraded")["status"], st.get("consecutiveFailures", 0)) == ("False", 0)
        assert entrypoint_info(pod)["state"] == P.EntrypointState.SUSPENDED.value
        assert state_changes_since(env.driver, mark), "the capture locked and checkpointed the worker"
        await set_desired(api, pod, "Active")
        await wait_ws(api, pod, "Active", state_is("Active", suspended=False), agents=env.agents)
        await quiesce(cluster, pod, serving=True)
        await _pinned(env, pod)
    finally:
        await _release(cluster, env, pod)


async def test_capture_is_refused_while_requests_are_in_flight_by_the_workers_own_metrics(
        cluster: LocalCluster, env: Env) -> None:
    api = cluster.api
    pod = env.pod("worker", 0)
    wid = env.ids[pod.name]
    # The series the agent measures in-flight and activity by are on the worker's own system port.
    names = metric_names(await worker_metrics(pod))
    print("metric families on the mocker's system port:", " ".join(names))
    assert INFLIGHT in names and REQUESTS in names, names
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    streams: list[asyncio.Task[StreamedChat]] = []
    try:
        await wait_ws(api, pod, "Accepted, Active", state_is("Active"), agents=env.agents)
        await env.fe.wait_routable(wid)
        # Two long requests pinned to the worker, started while it serves.
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(stream_chat(env.fe, worker_id=wid, max_tokens=LONG_TOKENS, started=s))
                   for s in started]
        for s in started:
            await asyncio.wait_for(s.wait(), 60)

        async def two_in_flight() -> bool:
            return metric_sum(await worker_metrics(pod), INFLIGHT) == 2
        await eventually("two requests in flight on the worker", two_in_flight, timeout=30)
        mark = len(env.driver.calls())
        await quiesce(cluster, pod, serving=False)  # out of serving, but the requests go on
        await set_desired(api, pod, "Suspended")
        ws = await wait_ws(api, pod, "refused: requests in flight",
                           refused_or_capturing(P.Reason.WORKER_SERVING.value, containing="requests in flight"),
                           agents=env.agents)
        err = ws["status"].get("lastError") or {}
        assert re.fullmatch(r"2 requests in flight", err["message"]), err
        assert condition(ws, "Degraded")["reason"] == P.Reason.WORKER_SERVING.value
        _untouched(env, [pod], mark)
        # The requests finish, answered in full by this worker; then the capture goes ahead.
        for t in streams:
            res = await asyncio.wait_for(t, 300)
            assert res.status == 200 and res.done and res.finish_reason == "length", res
            assert res.chunks >= LONG_TOKENS // 2, res.chunks
            assert res.worker_ids == {wid}, res.worker_ids
        asleep = await wait_ws(api, pod, "Suspended once the requests are done",
                               state_is("Suspended", suspended=True), agents=env.agents)
        assert asleep["status"]["lastCapture"]["ok"] is True
        await set_desired(api, pod, "Active")
        await wait_ws(api, pod, "Active", state_is("Active", suspended=False), agents=env.agents)
        await quiesce(cluster, pod, serving=True)
        await _pinned(env, pod)
    finally:
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await _release(cluster, env, pod)


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


# -- 5. idle facts at the edge ----------------------------------------------------------------------

def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


async def test_idle_facts_follow_the_workers_own_metrics_and_a_quiet_worker_is_not_rewritten(
        cluster: LocalCluster, env: Env) -> None:
    api = cluster.api
    pod = env.pod("worker", 1)
    await api.create(R.WORKER_SNAPSHOTS, ws_body(pod, tier="suspend"))
    try:
        def quiet(ws: Obj) -> bool:
            idle = (ws.get("status") or {}).get("idle") or {}
            return bool(idle.get("idleSince"))
        ws = await wait_ws(api, pod, "idleSince set", quiet, agents=env.agents)
        assert condition(ws, "Accepted")["status"] == "True"
        idle0, rv0 = ws["status"]["idle"], ws["metadata"]["resourceVersion"]
        assert idle0["inflight"] == 0
        assert idle0["requestsTotal"] == metric_sum(await worker_metrics(pod), REQUESTS)
        # Quiet: the agent scrapes the worker (one TCP connection each, seen from the node) and
        # writes nothing.
        seen = connections_to(pod.ip, P.DYNAMO_SYSTEM_PORT)

        async def scraped_thrice() -> bool:
            return len(connections_to(pod.ip, P.DYNAMO_SYSTEM_PORT) - seen) >= 3
        await eventually("three more scrapes of the quiet worker", scraped_thrice, timeout=60)
        again = await api.get(R.WORKER_SNAPSHOTS, pod.name, namespace=pod.namespace)
        assert again["metadata"]["resourceVersion"] == rv0, "a quiet worker's WorkerSnapshot was rewritten"
        # Activity: requests move the worker's counter; lastActivity follows, idleSince is set anew
        # from it once the worker is quiet again.
        await _pinned(env, pod, n=3)

        def quiet_again(ws: Obj) -> bool:
            idle = (ws.get("status") or {}).get("idle") or {}
            return (idle.get("requestsTotal", 0) >= idle0["requestsTotal"] + 3 and bool(idle.get("idleSince"))
                    and idle.get("lastActivity") is not None)
        ws = await wait_ws(api, pod, "activity seen, then quiet again", quiet_again, agents=env.agents)
        idle1 = ws["status"]["idle"]
        assert _ts(idle1["lastActivity"]) > _ts(idle0["idleSince"])
        assert idle1["idleSince"] == idle1["lastActivity"], "idle since its last activity"
        assert idle1["inflight"] == 0
    finally:
        await _release(cluster, env, pod)
