"""The controller under faults (issue 9) on the real node (kubelet, containerd, runc; dynsnap installed
by ``helm install``: realnodeenv.py), each ending consistent and explained, asserted by the reason,
Event or condition that says why and by the final state of the pods, WorkerSnapshots, images and
serving gates:

1. A bad annotation while a worker is drained for a capture: the capture is called off and the worker
   returns to serving, verified (bad annotations on a serving graph and on a graph never valid:
   node/test_controller_policy.py).
2. The DGD deleted while a worker is being captured (the stub driver holds its GPU save), then while a
   worker sleeps: the garbage collector deletes the pods (kubelet stops their containers) and the
   WorkerSnapshots, the agent deletes the gone pods' images, no helper is left running for them, and
   the controller serves the next graph.
3. A sleeping worker's pod deleted with the orphan policy (the garbage collector leaves its
   WorkerSnapshot, as when it lags behind the operator) and recreated under its name: the controller
   deletes the old WorkerSnapshot (UID precondition, Event ``PodReplaced``), the new pod gets a new one
   and is served cold, the old capture never restored into it and its images deleted.
4. The controller killed at each step of a cycle: its container's processes stopped (SIGSTOP: it
   writes nothing more), its pod deleted (kubelet SIGKILLs what it cannot stop), the Deployment's next
   pod takes the Lease: the worker ends captured, or awake with its wake verified; never out of serving
   with Active wanted, never a wake unproven.
5. Its watches answered 410 Gone while it is blind to a change: it relists and completes the cycle.

The chart's controller reaches the API server through fake_apiproxy on the bridge's gateway
(realnodeenv.controller_through_proxy, a ``helm upgrade`` of the shared install for the module), which
stands in for a troubled hop to the API server: it holds the controller at one step of a cycle (by
answering the write of the next step 503, so each retry fails there) and answers its watches 410.
Every wait is bounded; no test asserts a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path

import pytest
from controllerenv import (
    asleep,
    cond,
    events_for,
    gate_of,
    gate_path,
    get_ws,
    own_instance,
    policy,
    record,
    refuse,
    verified_wake,
    wait_ws,
    ws_path,
)
from helperprocs import helpers_for
from realnodecycle import override
from realnodeenv import (
    NS,
    WORKER_COMPONENT,
    Env,
    chart_pod,
    component_policy,
    controller_through_proxy,
    deployed,
    edit_dgd,
)
from realnodefacts import container_pid, container_procs, kubelet_facts, stub_state
from restart_faults import unhang

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node, real_graph
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault
from dynsnap.testenv.real_graph import Graph, NodePod

pytestmark = pytest.mark.cluster

# The controller's informers (controller/main.py): name -> the resource whose watch it holds.
INFORMERS = {"dgds": R.DGDS, "pods": R.PODS, "dwms": R.DWMS, "endpointslices": R.ENDPOINT_SLICES,
             "workersnapshots": R.WORKER_SNAPSHOTS}
RUNNING = 0  # the stub driver's state of a running GPU process
HANG_MS = 20000  # the longest the driver holds a call here (let go as soon as the test has what it needs)
GC_BOUND = 150  # the agent's image GC runs every minute (the chart's agent.gcInterval)


@pytest.fixture(scope="module")
async def proxy(env: Env) -> AsyncIterator[FakeApiProxy]:
    """The chart's controller through fake_apiproxy, with a wake deadline that outlasts a controller's
    restart (its next pod waits out the old one's Lease) and the quiesce and verification bounds the
    cases wait for."""
    async with controller_through_proxy(env, wakeTimeout=180, quiesceTimeout=60, verifyTimeout=30) as p:
        yield p


def _body(env: Env, name: str, *, tier: str = "suspend") -> Obj:
    """examples/dgd/agg.yaml's two workers, asleep only when a test asks (idle-after 1h), one kept serving."""
    body = chart_node.example_body(env, name=name, worker_replicas=2, speedup_ratio=1, policy=policy(
        enabled=True, idle_after="1h", tier=tier))
    return component_policy(body, WORKER_COMPONENT, policy(min_active=1, verify_requests=2))


def _workers(g: Graph) -> list[NodePod]:
    return g.workers(WORKER_COMPONENT)


def _image_dir(env: Env, pod: NodePod) -> Path:
    return env.paths.images / f"{pod.namespace}_{pod.name}_{pod.uid}"


async def _pod(env: Env, pod: NodePod) -> Obj | None:
    with contextlib.suppress(NotFound):
        return await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    return None


async def _gate(env: Env, pod: NodePod) -> str | None:
    live = await _pod(env, pod)
    return None if live is None else gate_of(live)


async def _in_serving(env: Env, pod: NodePod) -> None:
    """The pod serves: its gate True and kubelet's Ready True (bounded wait)."""
    async def check() -> bool:
        live = await _pod(env, pod)
        return live is not None and gate_of(live) == "True" and chart_node.pod_ready(live)
    await wait_for(f"{pod.name}: serving gate True, Ready", check, timeout=90, interval=0.2)


def serving(ws: Obj | None) -> bool:
    """Awake and not in the middle of anything: Active wanted and observed, no quiesce open, and the
    last return from a quiesce (if any) verified."""
    rec = record(ws)
    q = rec.get("quiesce") or {}
    v = rec.get("verification") or {}
    return bool(ws and ws["spec"]["desiredState"] == "Active" and (ws.get("status") or {}).get("state") == "Active"
                and (not q or (q.get("finished") and v.get("ok") is True
                               and datetime.fromisoformat(v["started"]) >= datetime.fromisoformat(q["started"]))))


async def _events(env: Env, pod: NodePod, reason: str) -> list[Obj]:
    return [e for e in await events_for(env.api, pod.namespace, pod.name) if e.get("reason") == reason]


async def _controller_log(env: Env) -> str:
    """The controller's log since its pod started (``kubectl logs``)."""
    pod = await chart_pod(env, "controller")
    return await env.pod_log(NS, pod["metadata"]["name"], "controller", tail=20000)


# -- 2. the DGD deleted mid-cycle --------------------------------------------------------------------------------

async def _graph_gone(env: Env, g: Graph, *, images: list[NodePod], helpers: dict[str, tuple[int, int]]) -> None:
    """After the DGD's deletion: its pods deleted by the garbage collector (kubelet stopped their
    containers), their WorkerSnapshots too, the images of ``images`` deleted by the agent, and no
    dynsnap-cuda or CRIU left running for the pods of ``helpers`` (name -> (pid namespace, PID 1))."""
    pods = [p for ps in g.pods.values() for p in ps]

    async def pods_gone() -> bool:
        return all([await _pod(env, p) is None for p in pods])
    await wait_for(f"the pods of {g.dgd['metadata']['name']} deleted", pods_gone, timeout=180, interval=0.5)
    for p in _workers(g):
        async def ws_gone(p: NodePod = p) -> bool:
            return await get_ws(env.api, p) is None
        await wait_for(f"{p.name}: WorkerSnapshot collected", ws_gone, timeout=120, interval=0.5)
    for p in images:
        async def collected(p: NodePod = p) -> bool:
            return not _image_dir(env, p).exists()
        await wait_for(f"{p.name} ({p.uid}): images deleted by the agent's image GC", collected, timeout=GC_BOUND,
                       interval=0.5)
    for name, (ns, pid1) in helpers.items():
        async def no_helpers(ns: int = ns, pid1: int = pid1) -> bool:
            return not helpers_for(ns, pid1)
        await wait_for(f"{name}: no CRIU or dynsnap-cuda left running for it", no_helpers, timeout=60, interval=0.5)


async def _pid_ns_and_entrypoint(env: Env, pod: NodePod) -> tuple[int, int]:
    facts = await kubelet_facts(env.api, pod)
    ep = container_procs(pod.uid, facts.container_id).entrypoint
    ns = procfs.pid_ns(ep)
    assert ns is not None
    return ns, ep


async def test_graph_deleted_while_capturing_and_while_asleep_leaves_nothing_and_the_next_is_served(
        env: Env, proxy: FakeApiProxy) -> None:
    """First a graph deleted while a worker's capture is in flight (tier snapshot; the stub driver holds
    its GPU save), then a graph deleted while a worker sleeps (its snapshot on disk); after each, the
    next graph is served: its worker captured, and (the last) woken and verified."""
    async with deployed(env, _body(env, "gone-capturing", tier="snapshot")) as g1:
        victim = _workers(g1)[0]
        helpers = {p.name: await _pid_ns_and_entrypoint(env, p) for p in _workers(g1)}
        env.driver.control(f"hang cuCheckpointProcessCheckpoint * {HANG_MS}")
        try:
            await override(env, victim, "suspended")
            ns, ep = helpers[victim.name]

            async def saving() -> bool:
                return any(h.op == "save" for h in helpers_for(ns, ep))
            await wait_for("the agent's save helper held in the driver", saving, timeout=120, interval=0.2)
            ws = await get_ws(env.api, victim)
            assert ws is not None and ws["spec"]["desiredState"] == "Suspended" and ws["status"]["state"] == "Capturing"
            await env.api.delete(R.DGDS, g1.dgd["metadata"]["name"], namespace=g1.dgd["metadata"]["namespace"])
            unhang(env.driver)
            await _graph_gone(env, g1, images=[victim], helpers=helpers)
        finally:
            unhang(env.driver)

    async with deployed(env, _body(env, "gone-asleep", tier="snapshot")) as g2:
        sleeper = _workers(g2)[0]
        helpers = {sleeper.name: await _pid_ns_and_entrypoint(env, sleeper)}
        await override(env, sleeper, "suspended")
        await wait_ws(env, sleeper, "captured (the graph after the first deletion)", asleep, timeout=180)
        captures = [d for d in _image_dir(env, sleeper).iterdir() if not d.name.startswith(P.STAGING_PREFIX)]
        assert len(captures) == 1 and (captures[0] / P.MANIFEST_FILE).is_file(), captures
        await env.api.delete(R.DGDS, g2.dgd["metadata"]["name"], namespace=g2.dgd["metadata"]["namespace"])
        await _graph_gone(env, g2, images=[sleeper], helpers=helpers)

    async with deployed(env, _body(env, "after-gone", tier="snapshot")) as g3:
        sleeper = _workers(g3)[0]
        await override(env, sleeper, "suspended")
        await wait_ws(env, sleeper, "captured (the graph after the second deletion)", asleep, timeout=180)
        await override(env, sleeper, "active")
        await wait_ws(env, sleeper, "woken and verified", verified_wake, timeout=180)
        await _in_serving(env, sleeper)


# -- 3. the pod recreated by the operator while its old incarnation sleeps ----------------------------------------

async def test_pod_recreated_while_asleep_is_served_cold_never_given_the_old_capture(
        env: Env, proxy: FakeApiProxy) -> None:
    """A worker asleep (snapshot) when its pod is deleted with the orphan policy (kubelet stops its
    container; the garbage collector leaves the WorkerSnapshot) and the operator's stand-in recreates it
    under the same name: the controller deletes the old WorkerSnapshot (its UID as precondition) with an
    Event PodReplaced and creates one for the new UID; the agent deletes the old UID's images; the new
    pod starts cold (no restore, no wake, no GPU restore call) and requests pinned to it are answered by it."""
    async with deployed(env, _body(env, "recreated", tier="snapshot")) as g:
        old = _workers(g)[0]
        first = await kubelet_facts(env.api, old)
        pid_ns, _ = await _pid_ns_and_entrypoint(env, old)
        await override(env, old, "suspended")
        old_ws = await wait_ws(env, old, "captured", asleep, timeout=180)
        old_dir = _image_dir(env, old)
        assert any(not d.name.startswith(P.STAGING_PREFIX) for d in old_dir.iterdir())
        calls = len(env.driver.calls())
        await env.api.delete(R.PODS, old.name, namespace=old.namespace, propagation="Orphan")
        new = await real_graph.recreate(env.api, g, old, driver=env.driver, pid_ns=pid_ns)
        assert new.name == old.name and new.uid != old.uid

        async def replaced() -> Obj | None:
            return next((e for e in await _events(env, new, P.Reason.POD_REPLACED.value)
                         if new.uid in (e.get("note") or "")), None)
        ev: Obj = await wait_for("Event PodReplaced", replaced, timeout=90, interval=0.5)
        assert old.uid in ev["note"] and "never restored" in ev["note"], ev
        ws = await wait_ws(env, new, "a WorkerSnapshot for the new pod, Active", lambda ws: bool(
            ws and ws["spec"]["podUID"] == new.uid and (ws.get("status") or {}).get("state") == "Active"))
        assert ws["metadata"]["uid"] != old_ws["metadata"]["uid"]

        async def collected() -> bool:
            return not old_dir.exists()
        await wait_for("the old pod's images deleted by the agent", collected, timeout=GC_BOUND, interval=0.5)
        await _in_serving(env, new)
        iid: int = await wait_for("the new pod's DWM, owned by it, with its instance id",
                                  lambda: own_instance(env.api, new), timeout=90, interval=0.5)
        assert env.fe is not None
        await env.fe.wait_routable(iid, timeout=120)
        for i in range(3):
            res = await env.fe.chat(f"cold {i}", worker_id=iid, max_tokens=2)
            assert res.status == 200 and res.worker_id == iid, res.body
        cold = await get_ws(env.api, new)
        assert cold is not None and cold["spec"]["desiredState"] == "Active", cold
        st = cold["status"]
        assert not st.get("lastWake") and not st.get("lastCapture") and not st.get("image"), st
        assert not record(cold).get("quiesce") and not record(cold).get("verification"), record(cold)
        acc = cond(cold, "Accepted")
        assert acc is not None and acc["status"] == "True", acc
        assert not _image_dir(env, new).exists()
        now = await kubelet_facts(env.api, new)
        assert now.uid == new.uid and now.container_id != first.container_id and now.restart_count == 0
        assert stub_state(env.driver, container_procs(new.uid, now.container_id).root) == RUNNING
        restored = [c for c in env.driver.calls()[calls:] if c.startswith(("cuCheckpointProcessRestore",
                                                                           "cuCheckpointProcessUnlock"))]
        assert not restored, restored


# -- 4. the controller killed at each step of a cycle -------------------------------------------------------------

@pytest.fixture(scope="module")
async def cycle(env: Env, proxy: FakeApiProxy) -> AsyncIterator[Graph]:
    """Two workers that stay awake by themselves (idle-after 1h, min-active 1); the tests move the first
    through captures and wakes with the manual override, as ``dynsnap suspend|wake`` does."""
    async with deployed(env, _body(env, "cycle")) as g:
        yield g


CAPTURE_STEPS = ("quiesce-decided", "gate-false", "capture-requested")
WAKE_STEPS = ("wake-requested", "verifying")


async def _baseline(env: Env, proxy: FakeApiProxy, g: Graph) -> None:
    """Both workers awake and serving, no override, no fault."""
    proxy.clear()
    unhang(env.driver)
    for p in _workers(g):
        await override(env, p, None)
    for p in _workers(g):
        if asleep(await get_ws(env.api, p)):
            await override(env, p, "active")
            await wait_ws(env, p, "woken and verified", verified_wake, timeout=180)
            await override(env, p, None)
        await wait_ws(env, p, "awake and serving", serving, timeout=180)
        await _in_serving(env, p)


async def _hits(f: Fault) -> bool:
    return f.hits > 0


async def _restart(env: Env, proxy: FakeApiProxy) -> None:
    """The controller killed where it stands: its container's processes stopped (it writes nothing
    more), its pod deleted (kubelet kills what is stopped; the Deployment creates the next pod, not a
    restart in place under kubelet's crash back-off), the proxy's faults cleared; returns once the
    next pod is Ready (it waits out the old pod's Lease before it leads)."""
    old = await chart_pod(env, "controller")
    pid = container_pid(old, "controller")
    os.kill(pid, signal.SIGSTOP)
    proxy.clear()
    await env.api.delete(R.PODS, old["metadata"]["name"], namespace=NS, grace_period_seconds=1)

    async def next_ready() -> bool:
        pods = [p for p in await env.chart_pods("controller") if not p["metadata"].get("deletionTimestamp")]
        return len(pods) == 1 and pods[0]["metadata"]["uid"] != old["metadata"]["uid"] and \
            chart_node.pod_ready(pods[0])
    await wait_for("the Deployment's next controller pod Ready", next_ready, timeout=180, interval=0.5)
    assert procfs.status(pid) is None, "the stopped controller is gone with its pod"


async def _capture(env: Env, victim: NodePod) -> Obj:
    await override(env, victim, "suspended")
    return await wait_ws(env, victim, "captured, its quiesce closed", lambda ws: asleep(ws) and bool(
        (record(ws).get("quiesce") or {}).get("ok")), timeout=180)


async def _hold_at(env: Env, proxy: FakeApiProxy, victim: NodePod, step: str) -> None:
    """Drive the victim's cycle to ``step`` and hold the controller there (the write of the next step
    refused), checking that it is there."""
    api = env.api
    if step == "quiesce-decided":  # identity recorded, quiesce opened; the gate still True
        f = refuse(proxy, method="PATCH", path=gate_path(victim))
        await override(env, victim, "suspended")
        await wait_for("the gate write refused", lambda: _hits(f), timeout=120, interval=0.2)
        got = await get_ws(api, victim)
        q = record(got).get("quiesce") or {}
        assert record(got)["identity"]["podUID"] == victim.uid and q and not q.get("finished"), record(got)
        assert got is not None and got["spec"]["desiredState"] == "Active"
        assert await _gate(env, victim) == "True"
    elif step == "gate-false":  # out of serving and drained; desiredState still Active
        f = refuse(proxy, method="PATCH", path=ws_path(victim))
        await override(env, victim, "suspended")
        await wait_for("the desiredState write refused", lambda: _hits(f), timeout=120, interval=0.2)
        got = await get_ws(api, victim)
        q = record(got).get("quiesce") or {}
        assert [st["name"] for st in q.get("steps") or []] == [
            "gate", "endpoint-not-ready", "frontend-stopped-routing", "drained"], q
        assert got is not None and got["spec"]["desiredState"] == "Active"
        assert await _gate(env, victim) == "False"
    elif step == "capture-requested":  # desiredState Suspended; the quiesce not yet closed
        f = refuse(proxy, method="PATCH", path=ws_path(victim))
        await override(env, victim, "suspended")
        await wait_for("the desiredState write refused", lambda: _hits(f), timeout=120, interval=0.2)
        s = refuse(proxy, method="PATCH", path=ws_path(victim, status=True))
        proxy.faults.remove(f)
        await wait_for("the quiesce's closing write refused", lambda: _hits(s), timeout=120, interval=0.2)
        got = await get_ws(api, victim)
        assert got is not None and got["spec"]["desiredState"] == "Suspended", got
        assert not (record(got).get("quiesce") or {}).get("finished"), record(got)
        assert await _gate(env, victim) == "False"
    elif step == "wake-requested":  # desiredState Active, the agent at the wake; the gate False
        # A slow driver restore (a big worker's takes seconds) keeps the agent at the wake.
        env.driver.control("hang cuCheckpointProcessRestore * 8000")
        await override(env, victim, "active")
        await wait_ws(env, victim, "the agent waking it", lambda ws: bool(
            ws and ws["spec"]["desiredState"] == "Active" and ws["status"].get("state") == "Waking"))
        assert await _gate(env, victim) == "False"
    elif step == "verifying":  # woken, its verification begun, the gate True; the outcome not written
        f = refuse(proxy, method="PATCH", path=gate_path(victim))
        await override(env, victim, "active")
        await wait_for("the gate write refused", lambda: _hits(f), timeout=120, interval=0.2)
        got = await get_ws(api, victim)
        v = record(got).get("verification") or {}
        assert got is not None and v.get("ok") is None and v.get("wakeId") == got["status"]["lastWake"]["id"], v
        s = refuse(proxy, method="PATCH", path=ws_path(victim, status=True))
        proxy.faults.remove(f)

        async def gate_true_outcome_refused() -> bool:
            return await _gate(env, victim) == "True" and s.hits > 0
        await wait_for("the gate True, the verification's write refused", gate_true_outcome_refused, timeout=120,
                       interval=0.2)
        verified = cond(await get_ws(api, victim), "Verified")
        assert verified is not None and verified["status"] != "True", verified
    else:
        raise AssertionError(step)


@pytest.mark.parametrize("step", [*CAPTURE_STEPS, *WAKE_STEPS])
async def test_controller_killed_at_each_step_finishes_the_cycle_consistently(env: Env, proxy: FakeApiProxy,
                                                                            cycle: Graph, step: str) -> None:
    """Held at ``step`` (the write of the next step refused), killed, its pod replaced: a capture ends
    captured with its quiesce closed, a wake ends Verified=True for that wake; the peer serves on."""
    victim, peer = _workers(cycle)
    await _baseline(env, proxy, cycle)
    try:
        before: str | None = None
        if step in WAKE_STEPS:
            before = ((await _capture(env, victim))["status"].get("lastWake") or {}).get("id")
        await _hold_at(env, proxy, victim, step)
        await _restart(env, proxy)
        if step in CAPTURE_STEPS:
            ws = await wait_ws(env, victim, "captured, its quiesce closed", lambda ws: asleep(ws) and bool(
                (record(ws).get("quiesce") or {}).get("ok")), timeout=180)
            rec = record(ws)
            assert rec["identity"]["podUID"] == victim.uid and rec["quiesce"]["finished"], rec
            assert await _gate(env, victim) == "False"
        else:
            ws = await wait_ws(env, victim, "woken and verified", verified_wake, timeout=180)
            assert ws["status"]["lastWake"]["id"] != before and ws["status"]["lastWake"]["ok"] is True
            v = record(ws)["verification"]
            assert v["answered"] == v["requests"] == 2, v
            await _in_serving(env, victim)
        await _in_serving(env, peer)
        assert serving(await get_ws(env.api, peer))
    finally:
        proxy.clear()
        unhang(env.driver)


def _policy_invalid(problem: str) -> Callable[[Obj | None], bool]:
    def check(ws: Obj | None) -> bool:
        c = cond(ws, "PolicyValid")
        return bool(c and c["status"] == "False" and problem in c["message"])
    return check


async def _set_tier(env: Env, g: Graph, value: str) -> None:
    """``kubectl edit`` of the DGD's ``dynsnap.io/tier``."""
    def change(dgd: Obj) -> None:
        dgd["metadata"].setdefault("annotations", {})[P.ANN_TIER] = value
    await edit_dgd(env, g, change)


async def test_bad_annotation_mid_quiesce_calls_the_capture_off_and_the_worker_serves_again(
        env: Env, proxy: FakeApiProxy, cycle: Graph) -> None:
    """A worker out of serving for a capture (drained; its desiredState write held back) when a DGD
    annotation goes bad: nothing new is decided (no capture is requested), but the quiesce under way is
    called off and the worker returns to serving, proven as every return is; PolicyValid=False says
    why all along. Left as it was, a typo would keep it out of serving with Active wanted."""
    victim, peer = _workers(cycle)
    await _baseline(env, proxy, cycle)
    try:
        await _hold_at(env, proxy, victim, "gate-false")
        # read once the worker is held there: what must not move from here is the controller's spec
        generation = (await get_ws(env.api, victim) or {})["metadata"]["generation"]
        await _set_tier(env, cycle, "deep")
        problem = f"{P.ANN_TIER}='deep': must be one of suspend, snapshot"
        await wait_ws(env, victim, "PolicyValid=False", _policy_invalid(problem), timeout=60)
        proxy.clear()  # the desiredState write would go through now: none is made

        def called_off_and_verified(ws: Obj | None) -> bool:
            q = record(ws).get("quiesce") or {}
            v = record(ws).get("verification") or {}
            return bool(q.get("finished") and q.get("ok") is False and v.get("ok") is True
                        and datetime.fromisoformat(v["started"]) >= datetime.fromisoformat(q["started"]))
        ws = await wait_ws(env, victim, "the capture called off, the return verified", called_off_and_verified,
                           timeout=180)
        assert ws["spec"]["desiredState"] == "Active" and ws["metadata"]["generation"] == generation, ws["spec"]
        c = cond(ws, "PolicyValid")
        assert c is not None and c["status"] == "False" and problem in c["message"], c
        v = record(ws)["verification"]
        assert v["wakeId"].startswith("recall-") and v["answered"] == v["requests"] >= 1, v
        await _in_serving(env, victim)
        await _in_serving(env, peer)
        evs = await _events(env, victim, "Active")
        assert any("capture called off" in (e.get("note") or "") for e in evs), evs
    finally:
        proxy.clear()
        await override(env, victim, None)
        await _set_tier(env, cycle, "suspend")
    for p in _workers(cycle):
        await wait_ws(env, p, "PolicyValid=True", lambda ws: bool((c := cond(ws, "PolicyValid")) and
                                                                  c["status"] == "True"))


# -- 5. a watch answered 410 Gone ---------------------------------------------------------------------------------

GONE = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": "too old resource version: 1 (2)", "reason": "Expired", "code": 410}).encode()


async def _blind(proxy: FakeApiProxy) -> Fault:
    """The controller's watch streams cut and every new one held at the proxy: its stores stand still."""
    stall = proxy.add(Fault("stall", watch=True, times=None))
    proxy.abort_all()
    await proxy.wait_stalled(len(INFORMERS), timeout=60)
    return stall


async def _gone(proxy: FakeApiProxy) -> list[Fault]:
    """Its next watch of every resource answered 410 Gone (the point it would resume from compacted)."""
    proxy.clear()
    faults = [proxy.add(Fault("respond", watch=True, path_contains=f"/{res.plural}", status=410, body=GONE))
              for res in INFORMERS.values()]
    proxy.abort_all()  # the held watches cut; the informers come back for their 410
    proxy.release()  # (what was held goes on to a closed client)
    return faults


async def _relists(env: Env) -> dict[str, int]:
    log = await _controller_log(env)
    return {n: log.count(f"informer {n}: too old resource version: 1 (2); relisting") for n in INFORMERS}


async def test_watches_answered_410_relist_and_the_cycle_completes(env: Env, proxy: FakeApiProxy,
                                                                  cycle: Graph) -> None:
    """Blind twice (its watches held): once while a user asks for a capture, once while the agent wakes
    the worker. Each time the watches are then answered 410 Gone; the controller relists every informer
    and only from the relisted state learns what it missed: it captures the worker, then verifies the wake."""
    victim, peer = _workers(cycle)
    await _baseline(env, proxy, cycle)
    api = env.api
    ctl = await chart_pod(env, "controller")
    restarts = ctl["status"]["containerStatuses"][0]["restartCount"]
    start = await _relists(env)
    try:
        last_quiesce = (record(await get_ws(api, victim)).get("quiesce") or {}).get("id")
        await _blind(proxy)
        await override(env, victim, "suspended")
        await asyncio.sleep(2)  # what it would have needed to start the quiesce, had it seen the change
        ws = await get_ws(api, victim)
        assert ws is not None and ws["spec"]["desiredState"] == "Active"
        assert (record(ws).get("quiesce") or {}).get("id") == last_quiesce, record(ws)
        faults = await _gone(proxy)
        ws = await wait_ws(env, victim, "captured, its quiesce closed", lambda ws: asleep(ws) and bool(
            (record(ws).get("quiesce") or {}).get("ok")) and record(ws)["quiesce"]["id"] != last_quiesce, timeout=180)
        assert all(f.hits == 1 for f in faults), [(f.path_contains, f.hits) for f in faults]
        mid = await _relists(env)
        assert all(mid[n] == start[n] + 1 for n in INFORMERS), (start, mid)
        before = (ws["status"].get("lastWake") or {}).get("id")

        # Blind while the agent wakes it (a slow driver restore): the wake is done before it can see it.
        env.driver.control("hang cuCheckpointProcessRestore * 5000")
        await override(env, victim, "active")
        await wait_ws(env, victim, "wake requested", lambda ws: bool(ws and ws["spec"]["desiredState"] == "Active"))
        await _blind(proxy)
        ws = await wait_ws(env, victim, "woken by the agent", lambda ws: bool(
            ws and ws["status"].get("state") == "Active" and (ws["status"].get("lastWake") or {}).get("id") != before
            and (ws["status"].get("lastWake") or {}).get("ok") is True))
        assert await _gate(env, victim) == "False"  # the controller has not seen the wake
        assert (record(ws).get("verification") or {}).get("wakeId") != ws["status"]["lastWake"]["id"]
        faults = await _gone(proxy)
        ws = await wait_ws(env, victim, "woken and verified", verified_wake, timeout=180)
        assert all(f.hits == 1 for f in faults), [(f.path_contains, f.hits) for f in faults]
        end = await _relists(env)
        assert all(end[n] == start[n] + 2 for n in INFORMERS), (start, end)
        await _in_serving(env, victim)
        await _in_serving(env, peer)
        now = await chart_pod(env, "controller")
        assert now["metadata"]["uid"] == ctl["metadata"]["uid"] and \
            now["status"]["containerStatuses"][0]["restartCount"] == restarts, "it relisted, never restarted"
    finally:
        proxy.clear()
        proxy.release()
        unhang(env.driver)
