"""Wake on request (issue 20): a component with ``min-active: 0`` and ``wake-on-request: "true"``
(tier suspend) lets its last worker sleep too, *routable*: still in serving (its pod Ready through
the entrypoint's health answer, its endpoint ready, its DWM kept), so the frontend still lists the
model, and the first request that reaches it waits in it while the agent (watching its in-flight
gauge at the edge) wakes it; then the controller verifies the wake with pinned requests.

The workers are the stand-in engine (dynsnap/testenv/stub_engine.py, for vLLM) on the stub CUDA
driver, whose every token is a driver call that blocks while the driver holds the process
checkpointed and returns after the resume, as the real driver's do (DESIGN.md section 2). The
controller, the agents and the Dynamo frontend are the real ones.

- an aggregated graph: every worker asleep (the last one routable), the model still listed; a request
  after 60 s of full sleep is answered 200 with the text the worker gave before, by the woken worker;
  then nine more cycles (full sleep, one request) with no request failing and every wake verified;
- a disaggregated graph: prefill and decode, each with its own policy, all asleep, one request wakes
  the last worker of each and is answered;
- faults: the wake on request fails (its helper killed mid-resume): the waiting request gets an error
  within a bound, the wake ``Verified=False``, the fallback; a request that arrives while the last
  worker is being saved waits and is answered; two requests at once wake one worker, not two.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from controllerenv import CtlEnv, asleep, events_for, get_ws, policy, running, verified_after, wait_ws
from helperprocs import helpers_of

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynsnap_parts import StubDriver, engine_worker_component

pytestmark = pytest.mark.cluster

PROMPT = "the same words every time"
POLICY = {"enabled": True, "idle_after": "3s", "tier": "suspend", "min_active": 0, "wake_on_request": True,
          "wake_at_inflight": 4}


def agg(driver: StubDriver) -> Obj:
    w = engine_worker_component("worker", replicas=2, driver=driver, gib=0.25, kv_gib=0.25)
    body = D.dgd("wor", [D.frontend_component(), w])
    body["metadata"]["annotations"] = policy(**POLICY)
    return body


def disagg(driver: StubDriver) -> Obj:
    comps = []
    for role in ("prefill", "decode"):
        c = engine_worker_component(role, replicas=1, driver=driver, mode=role, sub=role, gib=0.25, kv_gib=0.25)
        c["annotations"] = policy(min_active=0, wake_on_request=True)  # each component its own policy
        comps.append(c)
    body = D.dgd("wor-disagg", [D.frontend_component(router_mode="kv"), *comps])
    body["metadata"]["annotations"] = policy(enabled=True, idle_after="3s", tier="suspend", wake_at_inflight=4)
    return body


def routable(ws: Obj | None) -> bool:
    """Asleep routable: asleep, and the agent's Suspended condition says Routable."""
    c = next((c for c in ((ws or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Suspended"), None)
    return asleep(ws) and c is not None and c["reason"] == "Routable" and bool((ws or {})["spec"].get("routable"))


async def _all_asleep(env: CtlEnv, component: str, timeout: float = 180) -> RunningPod:
    """Every worker of ``component`` asleep, exactly one routable (the last); that one."""
    pods = env.graph.workers(component)

    async def done() -> RunningPod | None:
        wss = [await get_ws(env.api, p) for p in pods]
        if not all(asleep(ws) for ws in wss):
            return None
        rout = [p for p, ws in zip(pods, wss, strict=True) if routable(ws)]
        assert len(rout) <= 1, "more than one worker of the component sleeps routable"
        return rout[0] if rout else None
    found: RunningPod = await wait_for(f"every {component} asleep, the last routable", done, timeout=timeout,
                                       interval=0.5)
    return found


async def _in_serving(env: CtlEnv, pod: RunningPod) -> None:
    """Asleep and still in serving: pod Ready, gate True, endpoint ready, the model listed."""
    live = await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    conds = {c["type"]: c["status"] for c in live["status"].get("conditions") or []}
    assert conds.get("Ready") == "True" and conds.get(P.CONDITION_SERVING) == "True", conds
    ep = await env.cluster.endpoint_of(pod, label_selector=f"{P.LABEL_DISCOVERY_ENABLED}=true")
    assert ep is not None and ep["conditions"]["ready"] is True, ep
    assert await env.fe.model_listed(), "the model left the frontend while its last worker sleeps"


async def _iid(env: CtlEnv, pod: RunningPod) -> int:
    return instance_id_from_dwm(await env.api.get(R.DWMS, pod.name, namespace=pod.namespace))


async def _reference(env: CtlEnv, component: str) -> str:
    """The text every worker gives for PROMPT while awake (the engine is deterministic, one seed)."""
    texts = set()
    for p in env.graph.workers(component):
        wid = await _iid(env, p)
        await env.fe.wait_routable(wid)
        r = await env.fe.chat(PROMPT, worker_id=wid)
        assert r.status == 200, r.body
        texts.add(r.text)
    assert len(texts) == 1, texts
    return texts.pop()


async def _wake_by_one_request(env: CtlEnv, pod: RunningPod, reference: str) -> Obj:
    """One unpinned request through the frontend while every worker sleeps: answered 200 with the
    reference text by the routable sleeper, which the agent woke; its wake verified by the controller."""
    before = ((await get_ws(env.api, pod)) or {})["status"].get("lastWake", {}).get("id")
    r = await env.fe.chat(PROMPT)
    assert r.status == 200, r.body
    assert r.text == reference
    assert r.worker_id == await _iid(env, pod), (r.worker_id, pod.name)
    ws = await wait_ws(env, pod, "its wake on request verified", verified_after(before), timeout=120)
    wake = ws["status"]["lastWake"]
    assert wake["trigger"] == "request" and wake["ok"] is True, wake
    assert [s["name"] for s in wake["steps"]] == ["resume", "settle-active"], wake["steps"]
    v = ws["status"]["controller"]["verification"]
    assert v["ok"] is True and v["answered"] == v["requests"] == 3, v
    return ws


async def test_the_last_worker_sleeps_routable_and_its_first_request_wakes_it(cluster: LocalCluster) -> None:
    async with running(cluster, agg) as env:
        reference = await _reference(env, "worker")
        last = await _all_asleep(env, "worker")
        await _in_serving(env, last)
        other = next(p for p in env.graph.workers("worker") if p is not last)
        assert not routable(await get_ws(env.api, other)), "the other worker sleeps as every sleeper does"
        # 60 s of full sleep, the model listed all along, then one request.
        for _ in range(12):
            await asyncio.sleep(5.0)
            assert await env.fe.model_listed()
        ws = await _wake_by_one_request(env, last, reference)
        assert ws["status"]["lastCapture"]["tier"] == "suspend"
        # Nine more cycles: all asleep again (the woken worker is the last awake: routable again), one request.
        for _ in range(9):
            last = await _all_asleep(env, "worker")
            await _in_serving(env, last)
            await _wake_by_one_request(env, last, reference)


async def test_a_disaggregated_graph_sleeps_both_roles_routable_and_one_request_wakes_them(
        cluster: LocalCluster) -> None:
    async with running(cluster, disagg) as env:
        pre, dec = env.graph.workers("prefill")[0], env.graph.workers("decode")[0]
        ids = {p.name: await _iid(env, p) for p in (pre, dec)}
        await env.fe.wait_routable(ids[dec.name], prefill_id=ids[pre.name])
        reference = (await env.fe.chat(PROMPT, worker_id=ids[dec.name], prefill_id=ids[pre.name])).text
        assert reference
        for role in ("prefill", "decode"):
            sleeper = await _all_asleep(env, role)
            await _in_serving(env, sleeper)
        before = {p.name: ((await get_ws(env.api, p)) or {})["status"].get("lastWake", {}).get("id")
                  for p in (pre, dec)}
        r = await env.fe.chat(PROMPT)
        assert r.status == 200 and r.text == reference, r.body
        assert (r.worker_id, r.prefill_worker_id) == (ids[dec.name], ids[pre.name])
        triggers = []
        for p in (pre, dec):
            ws = await wait_ws(env, p, "woken and verified", verified_after(before[p.name]), timeout=120)
            triggers.append(ws["status"]["lastWake"].get("trigger"))
        # The role the request reached first is woken by it; the other by it too, or by the demand it
        # makes (the frontend's in-flight count: the existing path), whichever comes first.
        assert "request" in triggers, triggers


async def _helper_running(env: CtlEnv, pod: RunningPod, op: str, timeout: float = 60) -> int:
    async def found() -> int | None:
        return next((h.pid for h in helpers_of(pod) if h.op == op), None)
    pid: int = await wait_for(f"dynsnap-cuda {op} running for {pod.name}", found, timeout=timeout, interval=0.05)
    return pid


async def test_a_failed_wake_on_request_ends_its_request_with_an_error_and_the_fallback(cluster: LocalCluster) -> None:
    """The resume of a wake on request held by the driver, then its helper killed (SIGKILL): the agent
    stops the worker, so the request it held ends with an error within a bound (the frontend answers
    it, no hang); the wake ends Verified=False with its reason, and the fallback (restart) deletes the
    pod for the operator to recreate cold."""
    async with running(cluster, agg) as env:
        last = await _all_asleep(env, "worker")
        uid = last.uid
        env.driver.control("hang cuCheckpointProcessRestore * 30000")
        request = asyncio.create_task(env.fe.chat(PROMPT))
        helper = await _helper_running(env, last, "resume")
        os.kill(helper, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            r = await asyncio.wait_for(request, 90)  # bounded: an answer (an error) comes, not a hang
            print(f"\nthe waiting request's answer: {r.status} {str(r.body)[:300]}")
            assert r.status != 200, r.body
        except Exception as e:  # the connection closed under it: an error too, within the bound
            assert not isinstance(e, TimeoutError), "the request waited past the bound: a hang"
        print(f"\nthe waiting request ended {time.monotonic() - t0:.1f} s after the helper was killed")
        env.driver.clear_faults()

        # The failed wake, told on the pod (its WorkerSnapshot may be gone with it by now: the fallback
        # is quick): the controller's Warning WakeFailed, "wake not verified; fallback: ColdRestart", with
        # the agent's why (WorkerLost).
        warnings: list[tuple[str, str]] = []

        async def told() -> Obj | None:
            evs = await events_for(env.api, last.namespace, last.name)
            warnings[:] = [(e.get("reason", ""), (e.get("note") or "")[:300]) for e in evs
                           if e.get("type") == "Warning"]
            return next((e for e in evs if e.get("type") == "Warning" and e.get("reason") == "WakeFailed"
                         and "wake not verified; fallback: ColdRestart" in (e.get("note") or "")), None)
        try:
            ev = await wait_for("the failed wake told on the pod", told, timeout=120, interval=0.5)
        except TimeoutError as e:
            raise AssertionError(f"{e}; the pod's Warnings: {warnings}") from e
        assert "WorkerLost: wake on request failed" in ev["note"], ev["note"]
        # The agent said it first, under its own reason: the worker it stopped, and why.
        lost = [n for r, n in warnings if r == "WorkerLost"]
        assert lost and "wake on request failed" in lost[0] and "stopped (SIGKILL)" in lost[0], warnings
        # The fallback (restart): the pod deleted, with its UID as precondition, for the operator to
        # recreate cold (the local operator stand-in recreates pods only when a test asks it to).
        async def deleted() -> bool:
            try:
                p = await env.api.get(R.PODS, last.name, namespace=last.namespace)
            except NotFound:
                return True
            return bool(p["metadata"]["uid"] != uid or p["metadata"].get("deletionTimestamp"))
        await wait_for("the pod deleted by the fallback", deleted, timeout=120, interval=0.5)


async def test_a_request_that_arrives_during_the_last_workers_save_waits_and_is_answered(
        cluster: LocalCluster) -> None:
    async with running(cluster, agg) as env:
        reference = await _reference(env, "worker")
        env.driver.control("hang cuCheckpointProcessCheckpoint * 4000")
        # The second sleeper is the routable one: wait for its save to be under way.
        pods = env.graph.workers("worker")

        async def saving() -> RunningPod | None:
            for p in pods:
                ws = await get_ws(env.api, p)
                if ws and ws["spec"].get("routable") and ws["spec"]["desiredState"] == "Suspended" and \
                        any(h.op == "save" for h in helpers_of(p)):
                    return p
            return None
        last: RunningPod = await wait_for("the routable save under way", saving, timeout=180, interval=0.1)
        r = await env.fe.chat(PROMPT)  # sent while the driver holds the save
        assert r.status == 200 and r.text == reference, r.body
        assert r.worker_id == await _iid(env, last)
        env.driver.clear_faults()


async def test_two_requests_at_once_wake_one_worker_not_two(cluster: LocalCluster) -> None:
    async with running(cluster, agg) as env:
        reference = await _reference(env, "worker")
        last = await _all_asleep(env, "worker")
        other = next(p for p in env.graph.workers("worker") if p is not last)
        other_wake = ((await get_ws(env.api, other)) or {})["status"].get("lastWake", {}).get("id")
        answers = await asyncio.gather(env.fe.chat(PROMPT), env.fe.chat(PROMPT))
        assert all(a.status == 200 and a.text == reference for a in answers), [a.body for a in answers]
        assert {a.worker_id for a in answers} == {await _iid(env, last)}
        woke = await wait_ws(env, last, "its wake verified", verified_after(None), timeout=120)
        assert woke["status"]["lastWake"]["trigger"] == "request", woke["status"]["lastWake"]
        ws = await get_ws(env.api, other)
        assert ws is not None and asleep(ws), "the second worker woke: demand 2 needs one at 4 per worker"
        assert ws["status"].get("lastWake", {}).get("id") == other_wake
