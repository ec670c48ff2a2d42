"""The controller under faults (issue 9): each ends consistent and explained, asserted by the reason,
Event or condition that says why and by the final state of the pods, WorkerSnapshots, images and
serving gates.

1. A bad annotation while a worker is drained for a capture: the capture is called off and the worker
   returns to serving, verified (bad annotations on a serving graph and on a graph never valid run
   on the real node: node/test_controller_policy.py).
2. The DGD deleted while a worker is being captured, then while a worker sleeps: pods and
   WorkerSnapshots go (garbage collector), the agents delete the gone pods' images, nothing is left
   running for them, and the controller serves the next graph.
3. A sleeping worker's pod recreated by the operator (same name, new UID): the old WorkerSnapshot
   is deleted (UID precondition, Event ``PodReplaced``), the new pod gets a new one and is served
   cold, the old capture is never restored into it and its images are deleted.
4. The controller SIGKILLed at each step of a cycle and restarted: the worker ends captured, or
   awake with its wake verified; never out of serving with Active wanted, never a wake unproven.
5. Its watches answered 410 Gone while it is blind to a change: it relists and completes the cycle.

The agents and the controller run as their own processes under their shipped RBAC for the whole
module (ctlfaultsenv.py); the controller reaches the API server through fake_apiproxy, which
stands in for a troubled hop to the API server: it holds the controller at one step of a cycle
(by answering the write of the next step 503, so each retry fails there) and answers its watches
410. Every wait is bounded; no test asserts a duration.

Sandbox, why: each case holds the controller at a step through fake_apiproxy (a refused write, 410
watches) or holds CRIU's exit in the agent (fake_held_criu), and the chart's pods are not yet held that
way (fake_apiproxy can listen on the bridge gateway now, as node/test_controller_quiesce.py uses it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable
from datetime import datetime

import pytest
import yaml
from controllerenv import cond, get_ws, own_instance, wait_ws
from ctlfaultsenv import (
    Deployed,
    Env,
    deploy,
    edit_annotations,
    events,
    eventually,
    gate_path,
    get_pod,
    graph_body,
    image_dir,
    pod_condition,
    record,
    refuse,
    set_override,
    standard,
    start_env,
    stop_env,
    suspended,
    undeploy,
    verified_wake,
    ws_path,
)
from faultsenv import gpu_states, helpers_running, pod_procs

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.runtime import procfs
from dynsnap.testenv.cluster import LocalCluster, RunningPod
from dynsnap.testenv.fake_apiproxy import Fault
from dynsnap.testenv.podlife import recreate_pod, stop_pods_gone

pytestmark = pytest.mark.cluster

# The controller's informers (controller/main.py): name -> the resource whose watch it holds.
INFORMERS = {"dgds": R.DGDS, "pods": R.PODS, "dwms": R.DWMS, "endpointslices": R.ENDPOINT_SLICES,
             "workersnapshots": R.WORKER_SNAPSHOTS}


@pytest.fixture(scope="module")
async def env(cluster: LocalCluster, request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    e = await start_env(cluster)
    failed = request.session.testsfailed
    try:
        yield e
    finally:
        await stop_env(e)
        if request.session.testsfailed > failed:
            print(f"\ncontroller and agent logs kept in {e.work}")
        else:
            shutil.rmtree(e.work, ignore_errors=True)


# -- shared checks ----------------------------------------------------------------------------------------------

def serving(ws: Obj | None) -> bool:
    """Awake and not in the middle of anything: Active wanted and observed, no quiesce open, and the
    last return from a quiesce (if any) verified."""
    rec = record(ws)
    q = rec.get("quiesce") or {}
    v = rec.get("verification") or {}
    return bool(ws and ws["spec"]["desiredState"] == "Active" and (ws.get("status") or {}).get("state") == "Active"
                and (not q or (q.get("finished") and v.get("ok") is True
                               and datetime.fromisoformat(v["started"]) >= datetime.fromisoformat(q["started"]))))


async def _gate(env: Env, pod: RunningPod) -> str | None:
    return pod_condition(await get_pod(env.api, pod), P.CONDITION_SERVING)


async def _in_serving(env: Env, pod: RunningPod) -> None:
    """The pod serves: its gate True and Ready (bounded wait: right after a pod starts, kwok's
    provisional Ready=True stands until the stub kubelet's first status write, so one read could lie)."""
    async def check() -> bool:
        live = await get_pod(env.api, pod)
        return pod_condition(live, P.CONDITION_SERVING) == "True" and pod_condition(live, "Ready") == "True"
    try:
        await eventually(f"{pod.name}: serving gate True, Ready", check, timeout=60)
    except TimeoutError:
        print("POD STATUS:", (await get_pod(env.api, pod) or {}).get("status"))
        raise


def _policy_invalid(problem: str) -> Callable[[Obj | None], bool]:
    def check(ws: Obj | None) -> bool:
        c = cond(ws, "PolicyValid")
        return bool(c and c["status"] == "False" and problem in c["message"])
    return check


# -- 2. the DGD deleted mid-cycle --------------------------------------------------------------------------------

async def _images_collected(env: Env, pod: RunningPod) -> None:
    """The pod's images directory deleted by its node agent's image GC (which logs what it deleted)."""
    d = image_dir(env, pod)

    async def collected() -> bool:
        return not d.exists() and str(d) in env.agent_on(pod.node).log_path.read_text()
    await eventually(f"{pod.name} ({pod.uid}): images deleted by the agent's image GC", collected, timeout=60)


async def _graph_gone(env: Env, g: Deployed, *, images: list[RunningPod]) -> None:
    """After the DGD's deletion: its pods deleted by the garbage collector (their containers stopped,
    as kubelet does), their WorkerSnapshots too, and the images of ``images`` deleted by the agents."""
    pods = [p for ps in g.graph.pods.values() for p in ps]

    async def pods_gone() -> bool:
        gone = all([await get_pod(env.api, p) is None for p in pods])
        await stop_pods_gone(env.cluster, driver=env.driver)
        return gone and not any((p.namespace, p.name) in env.cluster.pods for p in pods)
    await eventually(f"the pods of {g.name} deleted", pods_gone, timeout=120)
    for p in g.workers:
        async def ws_gone(p: RunningPod = p) -> bool:
            return await get_ws(env.api, p) is None
        await eventually(f"{p.name}: WorkerSnapshot collected", ws_gone, timeout=120)
    for p in images:
        await _images_collected(env, p)
    for p in g.workers:
        async def no_helpers(p: RunningPod = p) -> bool:
            return not helpers_running(p)  # CRIU in the pod's pid namespace dies with the pod
        await eventually(f"{p.name}: no CRIU or dynsnap-cuda left running for it", no_helpers, timeout=60)
    assert env.controller.proc is not None and env.controller.proc.alive(), "the controller exited"


async def _first_asleep(env: Env, g: Deployed) -> RunningPod | None:
    for p in g.workers:
        if suspended(await get_ws(env.api, p)):
            return p
    return None


async def test_graph_deleted_while_capturing_and_while_asleep_leaves_nothing_and_the_next_is_served(env: Env) -> None:
    """First a graph deleted while a worker's snapshot is in flight (its dump complete, CRIU's exit held
    back by fake_held_criu), then a graph deleted while a worker sleeps (its snapshot on disk); after
    each, a new graph is served: its idle worker captured, and (the last) woken and verified."""
    dgd_ann, comp_ann = standard(tier="snapshot")
    g1 = await deploy(env, graph_body("gone-capturing", env.driver, dgd=dgd_ann, worker=comp_ann))
    try:
        for p in g1.workers:
            env.held.hold(p.uid)

        async def capturing() -> RunningPod | None:
            log = env.held.log()
            return next((p for p in g1.workers if f"dumped {p.uid} 0" in log), None)
        try:
            victim: RunningPod = await eventually("a dump complete, CRIU's exit held back", capturing, timeout=120)
        except TimeoutError:
            for p in g1.workers:
                print(p.name, yaml.safe_dump((await get_ws(env.api, p) or {}).get("status")))
            raise
        ws = await get_ws(env.api, victim)
        assert ws is not None and ws["spec"]["desiredState"] == "Suspended" and ws["status"]["state"] == "Capturing"
        assert image_dir(env, victim).is_dir()
        await env.api.delete(R.DGDS, g1.name, namespace=g1.namespace)  # kubectl delete dgd
        await _graph_gone(env, g1, images=[])
        env.held.release()
        await _graph_gone(env, g1, images=[victim])
    finally:
        env.held.release()
        await undeploy(env, g1)

    g2 = await deploy(env, graph_body("gone-asleep", env.driver, dgd=dgd_ann, worker=comp_ann))
    try:
        async def one_asleep() -> RunningPod | None:
            return await _first_asleep(env, g2)
        sleeper: RunningPod = await eventually("a worker captured (the graph after the first deletion)", one_asleep)
        captures = [d for d in image_dir(env, sleeper).iterdir() if not d.name.startswith(P.STAGING_PREFIX)]
        assert len(captures) == 1 and (captures[0] / P.MANIFEST_FILE).is_file(), captures
        await env.api.delete(R.DGDS, g2.name, namespace=g2.namespace)
        await _graph_gone(env, g2, images=[sleeper])
    finally:
        await undeploy(env, g2)

    g3 = await deploy(env, graph_body("after-gone", env.driver, dgd=dgd_ann, worker=comp_ann))
    try:
        async def asleep3() -> RunningPod | None:
            return await _first_asleep(env, g3)
        sleeper = await eventually("a worker captured (the graph after the second deletion)", asleep3)
        await set_override(env.api, sleeper, "active")
        await wait_ws(env, sleeper, "woken and verified", verified_wake)
        await _in_serving(env, sleeper)
    finally:
        await undeploy(env, g3)


# -- 3. the pod recreated by the operator while its old incarnation sleeps ----------------------------------------

async def test_pod_recreated_while_asleep_is_served_cold_never_given_the_old_capture(env: Env) -> None:
    """A worker asleep (snapshot) when its pod is deleted with the orphan policy (the garbage collector
    leaves the WorkerSnapshot, as when it lags behind the operator) and the operator recreates it under
    the same name: the controller deletes the old WorkerSnapshot (its UID as precondition) with an
    Event PodReplaced and creates one for the new UID; the agent deletes the old UID's images; the new
    pod starts cold: no restore, no wake, and requests pinned to it are answered by it."""
    dgd_ann, comp_ann = standard(tier="snapshot", idle_after="1h")
    g = await deploy(env, graph_body("recreated", env.driver, dgd=dgd_ann, worker=comp_ann))
    try:
        old = g.workers[0]
        await set_override(env.api, old, "suspended")
        old_ws = await wait_ws(env, old, "captured", suspended)
        old_dir = image_dir(env, old)
        assert any(not d.name.startswith(P.STAGING_PREFIX) for d in old_dir.iterdir())
        calls_before = len(env.driver.calls())
        new = await recreate_pod(env.cluster, g.graph, old, propagation="Orphan", driver=env.driver)
        assert new.name == old.name and new.uid != old.uid

        async def replaced() -> Obj | None:
            evs = await events(env.api, new.namespace, name=new.name, reason="PodReplaced")
            return next((e for e in evs if new.uid in e.get("note", "")), None)
        ev: Obj = await eventually("Event PodReplaced", replaced, timeout=60)
        assert old.uid in ev["note"] and "never restored" in ev["note"], ev
        ws = await wait_ws(env, new, "a WorkerSnapshot for the new pod, Active", lambda ws: bool(
            ws and ws["spec"]["podUID"] == new.uid and (ws.get("status") or {}).get("state") == "Active"))
        assert ws["metadata"]["uid"] != old_ws["metadata"]["uid"]

        await _images_collected(env, old)
        # Served (cold): its gate set and Ready (first: kwok's provisional Ready=True can stand until the stub
        # kubelet's first status write, which takes the endpoint away again), its own DWM, and requests
        # pinned to it answered by it.
        await _in_serving(env, new)
        iid: int = await eventually("the new pod's DWM, owned by it, with its instance id",
                                    lambda: own_instance(env.api, new), timeout=60)
        await g.fe.wait_routable(iid)
        for i in range(3):
            res = await g.fe.chat(f"cold {i}", worker_id=iid, max_tokens=2)
            assert res.status == 200 and res.worker_id == iid, res.body
        # Cold: never captured, woken, restored or verified; its GPU process never restored.
        cold = await get_ws(env.api, new)
        assert cold is not None and cold["spec"]["desiredState"] == "Active", cold
        st = cold["status"]
        assert not st.get("lastWake") and not st.get("lastCapture") and not st.get("image"), st
        assert not record(cold).get("quiesce") and not record(cold).get("verification"), record(cold)
        acc = cond(cold, "Accepted")
        assert acc is not None and acc["status"] == "True", acc
        assert not image_dir(env, new).exists()
        states = gpu_states(env.driver, new)
        assert states and set(states.values()) == {"running"}, (states, [(q.pid, q.name, q.state, sorted(
            m for m in procfs.maps_paths(q.pid) if ".so" in m)) for q in pod_procs(new)])
        since = env.driver.calls()[calls_before:]
        for pid in states:
            touched = [c for c in since if f" pid={pid} " in c + " " and c.startswith("cuCheckpointProcess")
                       and not c.startswith(("cuCheckpointProcessGetState", "cuCheckpointProcessGetRestoreThreadId"))]
            assert not touched, touched
    finally:
        await undeploy(env, g)


# -- 4. the controller killed at each step of a cycle -------------------------------------------------------------

@pytest.fixture(scope="module")
async def cycle(env: Env) -> AsyncIterator[Deployed]:
    """Two workers that stay awake by themselves (idle-after 1h, min-active 1); the tests move the first
    through captures and wakes with the manual override, as ``dynsnap suspend|wake`` does."""
    dgd_ann, comp_ann = standard(idle_after="1h")
    g = await deploy(env, graph_body("cycle", env.driver, dgd=dgd_ann, worker=comp_ann))
    try:
        yield g
    finally:
        await undeploy(env, g)


CAPTURE_STEPS = ("quiesce-decided", "gate-false", "capture-requested")
WAKE_STEPS = ("wake-requested", "verifying")


async def _baseline(env: Env, g: Deployed) -> None:
    """Both workers awake and serving, no override, no fault."""
    env.proxy.clear()
    env.driver.clear_faults()
    if env.controller.proc is None:
        await env.start_controller()
    for p in g.workers:
        await set_override(env.api, p, None)
    for p in g.workers:
        if suspended(await get_ws(env.api, p)):
            await set_override(env.api, p, "active")
            await wait_ws(env, p, "woken and verified", verified_wake)
            await set_override(env.api, p, None)
        await wait_ws(env, p, "awake and serving", serving)
        await _in_serving(env, p)


async def _hits(f: Fault) -> bool:
    return f.hits > 0


async def _restart(env: Env) -> None:
    await env.kill_controller()
    env.proxy.clear()
    await env.start_controller()


async def _capture(env: Env, victim: RunningPod) -> Obj:
    await set_override(env.api, victim, "suspended")
    return await wait_ws(env, victim, "captured, its quiesce closed", lambda ws: suspended(ws) and bool(
        (record(ws).get("quiesce") or {}).get("ok")))


async def _hold_at(env: Env, victim: RunningPod, step: str) -> None:
    """Drive the victim's cycle to ``step`` and hold the controller there (the write of the next step
    refused), checking that it is there."""
    api = env.api
    if step == "quiesce-decided":  # identity recorded, quiesce opened; the gate still True
        f = refuse(env, method="PATCH", path=gate_path(victim))
        await set_override(api, victim, "suspended")
        await eventually("the gate write refused", lambda: _hits(f))
        got = await get_ws(api, victim)
        q = record(got).get("quiesce") or {}
        assert record(got)["identity"]["podUID"] == victim.uid and q and not q.get("finished"), record(got)
        assert got is not None and got["spec"]["desiredState"] == "Active"
        assert await _gate(env, victim) == "True"
    elif step == "gate-false":  # out of serving and drained; desiredState still Active
        f = refuse(env, method="PATCH", path=ws_path(victim))
        await set_override(api, victim, "suspended")
        await eventually("the desiredState write refused", lambda: _hits(f))
        got = await get_ws(api, victim)
        q = record(got).get("quiesce") or {}
        assert [st["name"] for st in q.get("steps") or []] == [
            "gate", "endpoint-not-ready", "frontend-stopped-routing", "drained"], q
        assert got is not None and got["spec"]["desiredState"] == "Active"
        assert await _gate(env, victim) == "False"
    elif step == "capture-requested":  # desiredState Suspended; the quiesce not yet closed
        f = refuse(env, method="PATCH", path=ws_path(victim))
        await set_override(api, victim, "suspended")
        await eventually("the desiredState write refused", lambda: _hits(f))
        s = refuse(env, method="PATCH", path=ws_path(victim, status=True))
        env.proxy.faults.remove(f)
        await eventually("the quiesce's closing write refused", lambda: _hits(s))
        got = await get_ws(api, victim)
        assert got is not None and got["spec"]["desiredState"] == "Suspended", got
        assert not (record(got).get("quiesce") or {}).get("finished"), record(got)
        assert await _gate(env, victim) == "False"
    elif step == "wake-requested":  # desiredState Active, the agent at the wake; the gate False
        # A slow driver restore (a big worker's takes seconds) keeps the agent at the wake.
        env.driver.control("hang cuCheckpointProcessRestore * 8000")
        await set_override(api, victim, "active")
        await wait_ws(env, victim, "the agent waking it", lambda ws: bool(
            ws and ws["spec"]["desiredState"] == "Active" and ws["status"].get("state") == "Waking"))
        assert await _gate(env, victim) == "False"
    elif step == "verifying":  # woken, its verification begun, the gate True; the outcome not written
        f = refuse(env, method="PATCH", path=gate_path(victim))
        await set_override(api, victim, "active")
        await eventually("the gate write refused", lambda: _hits(f))
        got = await get_ws(api, victim)
        v = record(got).get("verification") or {}
        assert got is not None and v.get("ok") is None and v.get("wakeId") == got["status"]["lastWake"]["id"], v
        s = refuse(env, method="PATCH", path=ws_path(victim, status=True))
        env.proxy.faults.remove(f)

        async def gate_true_outcome_refused() -> bool:
            return await _gate(env, victim) == "True" and s.hits > 0
        await eventually("the gate True, the verification's write refused", gate_true_outcome_refused)
        verified = cond(await get_ws(api, victim), "Verified")
        assert verified is not None and verified["status"] != "True", verified
    else:
        raise AssertionError(step)


@pytest.mark.parametrize("step", [*CAPTURE_STEPS, *WAKE_STEPS])
async def test_controller_killed_at_each_step_finishes_the_cycle_consistently(env: Env, cycle: Deployed,
                                                                            step: str) -> None:
    """Held at ``step`` (the write of the next step refused), SIGKILLed, restarted: a capture ends
    captured with its quiesce closed, a wake ends Verified=True for that wake; the peer serves on."""
    g = cycle
    victim, peer = g.workers
    await _baseline(env, g)
    try:
        before: str | None = None
        if step in WAKE_STEPS:
            before = ((await _capture(env, victim))["status"].get("lastWake") or {}).get("id")
        await _hold_at(env, victim, step)
        await _restart(env)
        if step in CAPTURE_STEPS:
            ws = await wait_ws(env, victim, "captured, its quiesce closed", lambda ws: suspended(ws) and bool(
                (record(ws).get("quiesce") or {}).get("ok")))
            rec = record(ws)
            assert rec["identity"]["podUID"] == victim.uid and rec["quiesce"]["finished"], rec
            assert await _gate(env, victim) == "False"
        else:
            ws = await wait_ws(env, victim, "woken and verified", verified_wake)
            assert ws["status"]["lastWake"]["id"] != before and ws["status"]["lastWake"]["ok"] is True
            v = record(ws)["verification"]
            assert v["answered"] == v["requests"] == 2, v
            await _in_serving(env, victim)
        await _in_serving(env, peer)
        assert serving(await get_ws(env.api, peer))
    finally:
        env.proxy.clear()
        env.driver.clear_faults()
        if env.controller.proc is None:
            await env.start_controller()


async def test_bad_annotation_mid_quiesce_calls_the_capture_off_and_the_worker_serves_again(env: Env,
                                                                                          cycle: Deployed) -> None:
    """A worker out of serving for a capture (drained; its desiredState write held back) when a DGD
    annotation goes bad: nothing new is decided (no capture is requested), but the quiesce under way is
    called off and the worker returns to serving, proven as every return is; PolicyValid=False says
    why all along. Left as it was, a typo would keep it out of serving with Active wanted."""
    g = cycle
    victim, peer = g.workers
    await _baseline(env, g)
    generation = (await get_ws(env.api, victim) or {})["metadata"]["generation"]
    try:
        await _hold_at(env, victim, "gate-false")
        await edit_annotations(env.api, g, dgd={P.ANN_TIER: "deep"})
        problem = f"{P.ANN_TIER}='deep': must be one of suspend, snapshot"
        await wait_ws(env, victim, "PolicyValid=False", _policy_invalid(problem), timeout=60)
        env.proxy.clear()  # the desiredState write would go through now: none is made

        def called_off_and_verified(ws: Obj | None) -> bool:
            q = record(ws).get("quiesce") or {}
            v = record(ws).get("verification") or {}
            return bool(q.get("finished") and q.get("ok") is False and v.get("ok") is True
                        and datetime.fromisoformat(v["started"]) >= datetime.fromisoformat(q["started"]))
        ws = await wait_ws(env, victim, "the capture called off, the return verified", called_off_and_verified)
        assert ws["spec"]["desiredState"] == "Active" and ws["metadata"]["generation"] == generation, ws["spec"]
        c = cond(ws, "PolicyValid")
        assert c is not None and c["status"] == "False" and problem in c["message"], c
        v = record(ws)["verification"]
        assert v["wakeId"].startswith("recall-") and v["answered"] == v["requests"] >= 1, v
        await _in_serving(env, victim)
        await _in_serving(env, peer)
        evs = await events(env.api, victim.namespace, name=victim.name, reason="Active")
        assert any("capture called off" in e["note"] for e in evs), evs
    finally:
        env.proxy.clear()
        await set_override(env.api, victim, None)
        await edit_annotations(env.api, g, dgd={P.ANN_TIER: "suspend"})
    for p in g.workers:
        await wait_ws(env, p, "PolicyValid=True", lambda ws: bool((c := cond(ws, "PolicyValid")) and
                                                                  c["status"] == "True"))


# -- 5. a watch answered 410 Gone ---------------------------------------------------------------------------------

GONE = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": "too old resource version: 1 (2)", "reason": "Expired", "code": 410}).encode()


async def _blind(env: Env) -> Fault:
    """The controller's watch streams cut and every new one held at the proxy: its stores stand still."""
    stall = env.proxy.add(Fault("stall", watch=True, times=None))
    env.proxy.abort_all()
    await env.proxy.wait_stalled(len(INFORMERS), timeout=60)
    return stall


async def _gone(env: Env) -> list[Fault]:
    """Its next watch of every resource answered 410 Gone (the point it would resume from compacted)."""
    env.proxy.clear()
    faults = [env.proxy.add(Fault("respond", watch=True, path_contains=f"/{res.plural}", status=410, body=GONE))
              for res in INFORMERS.values()]
    env.proxy.abort_all()  # the held watches cut; the informers come back for their 410
    env.proxy.release()  # (what was held goes on to a closed client)
    return faults


def _relists(env: Env) -> dict[str, int]:
    log = env.controller_log()
    return {n: log.count(f"informer {n}: too old resource version: 1 (2); relisting") for n in INFORMERS}


async def test_watches_answered_410_relist_and_the_cycle_completes(env: Env, cycle: Deployed) -> None:
    """Blind twice (its watches held): once while a user asks for a capture, once while the agent wakes
    the worker. Each time the watches are then answered 410 Gone; the controller relists every informer
    and only from the relisted state learns what it missed: it captures the worker, then verifies the wake."""
    g = cycle
    victim, peer = g.workers
    await _baseline(env, g)
    api = env.api
    start = _relists(env)
    try:
        # Blind while `dynsnap suspend` is asked: only the relist can tell it.
        last_quiesce = (record(await get_ws(api, victim)).get("quiesce") or {}).get("id")
        await _blind(env)
        await set_override(api, victim, "suspended")
        ws = await get_ws(api, victim)
        assert ws is not None and ws["spec"]["desiredState"] == "Active"
        assert (record(ws).get("quiesce") or {}).get("id") == last_quiesce, record(ws)
        faults = await _gone(env)
        ws = await wait_ws(env, victim, "captured, its quiesce closed", lambda ws: suspended(ws) and bool(
            (record(ws).get("quiesce") or {}).get("ok")) and record(ws)["quiesce"]["id"] != last_quiesce)
        assert all(f.hits == 1 for f in faults), [(f.path_contains, f.hits) for f in faults]
        mid = _relists(env)
        assert all(mid[n] == start[n] + 1 for n in INFORMERS), (start, mid)
        before = (ws["status"].get("lastWake") or {}).get("id")

        # Blind while the agent wakes it (a slow driver restore): the wake is done before it can see it.
        env.driver.control("hang cuCheckpointProcessRestore * 5000")
        await set_override(api, victim, "active")
        await wait_ws(env, victim, "wake requested", lambda ws: bool(ws and ws["spec"]["desiredState"] == "Active"))
        await _blind(env)
        ws = await wait_ws(env, victim, "woken by the agent", lambda ws: bool(
            ws and ws["status"].get("state") == "Active" and (ws["status"].get("lastWake") or {}).get("id") != before
            and (ws["status"].get("lastWake") or {}).get("ok") is True))
        assert await _gate(env, victim) == "False"  # the controller has not seen the wake
        assert (record(ws).get("verification") or {}).get("wakeId") != ws["status"]["lastWake"]["id"]
        faults = await _gone(env)
        ws = await wait_ws(env, victim, "woken and verified", verified_wake)
        assert all(f.hits == 1 for f in faults), [(f.path_contains, f.hits) for f in faults]
        end = _relists(env)
        assert all(end[n] == start[n] + 2 for n in INFORMERS), (start, end)
        await _in_serving(env, victim)
        await _in_serving(env, peer)
        assert env.controller.proc is not None and env.controller.proc.alive()
    finally:
        env.proxy.clear()
        env.proxy.release()
        env.driver.clear_faults()

