"""Wake on request (issue 20): a component with ``min-active: 0`` and ``wake-on-request: "true"``
(tier suspend) lets its last worker sleep too, *routable*: still in serving (its pod Ready through
the entrypoint's health answer, its endpoint ready, its DWM kept), so the frontend still lists the
model, and the first request that reaches it waits in it while the agent (watching its in-flight
gauge at the edge) wakes it; then the controller verifies the wake with pinned requests.

On the real node (kubelet, containerd, runc; dynsnap installed by ``helm install``: realnodeenv.py),
examples/dgd/agg.yaml and disagg.yaml under the local overlay. The workers are the stand-in engine
(dynsnap/testenv/stub_engine.py, for vLLM; real_graph.Engine) on the stub CUDA driver, whose every
token is a driver call that blocks while the driver holds the process checkpointed and returns after
the resume, as the real driver's do (DESIGN.md section 2). The controller and the agent (pods of the
chart) and the Dynamo frontend are the real ones.

- an aggregated graph: every worker asleep (the last one routable), the model still listed; a request
  after 60 s of full sleep is answered 200 with the text the worker gave before, by the woken worker;
  then nine more cycles (full sleep, one request) with no request failing and every wake verified;
- a disaggregated graph (examples/dgd/disagg.yaml, one prefill and one decode worker, each component
  its own policy): both asleep routable, one request wakes each and is answered by the pair;
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
from controllerenv import asleep, events_for, get_ws, policy, verified_after, wait_ws
from helperprocs import Helper, helpers_for
from realnodeenv import WORKER_COMPONENT, Env, component_policy, deployed, instance_id
from realnodefacts import container_procs
from routablecheck import all_asleep, in_serving, routable

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import resources as R
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import Engine, Graph, NodePod, kubelet_facts

pytestmark = pytest.mark.cluster

PROMPT = "the same words every time"
POLICY = {"enabled": True, "idle_after": "3s", "tier": "suspend", "min_active": 0, "wake_on_request": True,
          "wake_at_inflight": 4}
ENGINE = Engine(gib=0.25, kv_gib=0.25)
DISAGG = chart_node.ROOT / "examples" / "dgd" / "disagg.yaml"
ROLES = ("prefill", "decode")  # the example's component names, and their types


def agg(env: Env, name: str) -> Obj:
    """examples/dgd/agg.yaml: a frontend and two engine workers (the example's on-failed-wake: restart)."""
    return chart_node.example_body(env, name=name, engine=ENGINE, policy=policy(**POLICY))


async def _all_asleep(env: Env, g: Graph, component: str = WORKER_COMPONENT, timeout: float = 180) -> NodePod:
    return await all_asleep(env.api, g.workers(component), component, timeout)


async def _in_serving(env: Env, pod: NodePod) -> None:
    assert env.fe is not None
    await in_serving(env.cluster, env.fe, pod)


async def _reference(env: Env, g: Graph, component: str = WORKER_COMPONENT) -> str:
    """The text the workers give for PROMPT while awake (the engine is deterministic, one seed): every
    worker asked at once right after the deploy, and every one that answers gives the same. (One after
    the other, the second could be asleep already, idle-after being 3 s, before the frontend had routed
    to it: two lanes' load, 2026-12-07. A sleeper is not routable unless it is the last.)"""
    fe = env.fe
    assert fe is not None

    async def ask(p: NodePod) -> str | None:
        wid = await instance_id(env, p)
        try:
            await fe.wait_routable(wid)
        except TimeoutError:
            return None
        r = await fe.chat(PROMPT, worker_id=wid)
        return r.text if r.status == 200 and r.worker_id == wid else None

    texts = [t for t in await asyncio.gather(*(ask(p) for p in g.workers(component))) if t is not None]
    assert texts and len(set(texts)) == 1, texts
    return texts[0]


async def _wake_by_one_request(env: Env, pod: NodePod, reference: str) -> Obj:
    """One unpinned request through the frontend while every worker sleeps: answered 200 with the
    reference text by the routable sleeper, which the agent woke; its wake verified by the controller."""
    assert env.fe is not None
    before = ((await get_ws(env.api, pod)) or {})["status"].get("lastWake", {}).get("id")
    r = await env.fe.chat(PROMPT)
    assert r.status == 200, r.body
    assert r.text == reference
    assert r.worker_id == await instance_id(env, pod), (r.worker_id, pod.name)
    ws = await wait_ws(env, pod, "its wake on request verified", verified_after(before), timeout=120)
    wake = ws["status"]["lastWake"]
    assert wake["trigger"] == "request" and wake["ok"] is True, wake
    assert [s["name"] for s in wake["steps"]] == ["resume", "settle-active"], wake["steps"]
    v = ws["status"]["controller"]["verification"]
    assert v["ok"] is True and v["answered"] == v["requests"] == 3, v
    return ws


async def test_the_last_worker_sleeps_routable_and_its_first_request_wakes_it(env: Env) -> None:
    async with deployed(env, agg(env, "wor")) as g:
        assert env.fe is not None
        reference = await _reference(env, g)
        first = {p.name: await kubelet_facts(env.api, p) for p in g.workers(WORKER_COMPONENT)}
        last = await _all_asleep(env, g)
        await _in_serving(env, last)
        other = next(p for p in g.workers(WORKER_COMPONENT) if p != last)
        assert not routable(await get_ws(env.api, other)), "the other worker sleeps as every sleeper does"
        # 60 s of full sleep, the model listed all along, then one request.
        for _ in range(12):
            await asyncio.sleep(5.0)
            assert await env.fe.model_listed()
        ws = await _wake_by_one_request(env, last, reference)
        assert ws["status"]["lastCapture"]["tier"] == "suspend"
        # Nine more cycles: all asleep again (the woken worker is the last awake: routable again), one request.
        for _ in range(9):
            last = await _all_asleep(env, g)
            await _in_serving(env, last)
            await _wake_by_one_request(env, last, reference)
        for p in g.workers(WORKER_COMPONENT):  # kubelet's own account: the same container, never restarted
            now = await kubelet_facts(env.api, p)
            assert (now.container_id, now.restart_count, now.running) == (first[p.name].container_id, 0, True), now


def disagg(env: Env) -> Obj:
    """examples/dgd/disagg.yaml with one worker of each role, each component its own policy (the graph's
    own says the rest: tier suspend, the frontend's in-flight threshold)."""
    graph = {k: v for k, v in POLICY.items() if k not in ("min_active", "wake_on_request")}
    body = chart_node.example_body(env, example=DISAGG, name="wor-disagg", engine=ENGINE, worker_replicas=1,
                                   policy=policy(**graph))
    for role in ROLES:
        component_policy(body, role, policy(min_active=0, wake_on_request=True))
    return body


async def test_a_disaggregated_graph_sleeps_both_roles_routable_and_one_request_wakes_them(env: Env) -> None:
    async with deployed(env, disagg(env)) as g:
        assert env.fe is not None
        pre, dec = g.workers("prefill")[0], g.workers("decode")[0]
        ids = {p.name: await instance_id(env, p) for p in (pre, dec)}
        await env.fe.wait_routable(ids[dec.name], prefill_id=ids[pre.name])
        reference = (await env.fe.chat(PROMPT, worker_id=ids[dec.name], prefill_id=ids[pre.name])).text
        assert reference
        first = {p.name: await kubelet_facts(env.api, p) for p in (pre, dec)}
        for role in ROLES:
            await _in_serving(env, await _all_asleep(env, g, role))
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
        for p in (pre, dec):  # kubelet's own account: the same container, never restarted
            now = await kubelet_facts(env.api, p)
            assert (now.container_id, now.restart_count, now.running) == (first[p.name].container_id, 0, True), now


def _helpers(pod: NodePod, container_id: str, op: str) -> list[Helper]:
    """The agent's helpers (dynsnap-cuda, CRIU) running ``op`` for the worker's container now."""
    ep = container_procs(pod.uid, container_id).entrypoint
    return [h for h in helpers_for(procfs.pid_ns(ep), ep) if h.op == op]


async def _helper_running(env: Env, pod: NodePod, op: str, timeout: float = 60) -> int:
    cid = (await kubelet_facts(env.api, pod)).container_id

    async def found() -> int | None:
        return next((h.pid for h in _helpers(pod, cid, op)), None)
    pid: int = await wait_for(f"dynsnap-cuda {op} running for {pod.name}", found, timeout=timeout, interval=0.05)
    return pid


async def test_a_failed_wake_on_request_ends_its_request_with_an_error_and_the_fallback(env: Env) -> None:
    """The resume of a wake on request held by the driver, then its helper killed (SIGKILL): the agent
    stops the worker, so the request it held ends with an error within a bound (the frontend answers
    it, no hang); the wake ends Verified=False with its reason, and the fallback (restart) deletes the
    pod for the operator to recreate cold (the example's on-failed-wake)."""
    async with deployed(env, agg(env, "wor-failed")) as g:
        assert env.fe is not None
        last = await _all_asleep(env, g)
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
        # The agent said it too, under its own reason: the worker it stopped, and why. (A later wake asked
        # of the stopped worker may add a second WorkerLost, "give-up: the worker tree is gone"; the API
        # lists Events by name, not by time, so the one for the wake on request is looked for by content.)
        lost = [n for r, n in warnings if r == "WorkerLost" and "wake on request failed" in n]
        assert lost and "stopped (SIGKILL)" in lost[0], warnings
        # The fallback (restart): the pod deleted, with its UID as precondition, for the operator to
        # recreate cold (the local operator stand-in recreates pods only when a test asks it to).
        async def deleted() -> bool:
            try:
                p = await env.api.get(R.PODS, last.name, namespace=last.namespace)
            except NotFound:
                return True
            return bool(p["metadata"]["uid"] != uid or p["metadata"].get("deletionTimestamp"))
        await wait_for("the pod deleted by the fallback", deleted, timeout=120, interval=0.5)


async def test_a_request_that_arrives_during_the_last_workers_save_waits_and_is_answered(env: Env) -> None:
    async with deployed(env, agg(env, "wor-saving")) as g:
        assert env.fe is not None
        reference = await _reference(env, g)
        pods = g.workers(WORKER_COMPONENT)
        cids = {p.name: (await kubelet_facts(env.api, p)).container_id for p in pods}
        env.driver.control("hang cuCheckpointProcessCheckpoint * 4000")
        # The second sleeper is the routable one: wait for its save to be under way.

        async def saving() -> NodePod | None:
            for p in pods:
                ws = await get_ws(env.api, p)
                if ws and ws["spec"].get("routable") and ws["spec"]["desiredState"] == "Suspended" and \
                        _helpers(p, cids[p.name], "save"):
                    return p
            return None
        last: NodePod = await wait_for("the routable save under way", saving, timeout=180, interval=0.1)
        r = await env.fe.chat(PROMPT)  # sent while the driver holds the save
        assert r.status == 200 and r.text == reference, r.body
        assert r.worker_id == await instance_id(env, last)
        env.driver.clear_faults()


async def test_two_requests_at_once_wake_one_worker_not_two(env: Env) -> None:
    async with deployed(env, agg(env, "wor-two")) as g:
        assert env.fe is not None
        reference = await _reference(env, g)
        last = await _all_asleep(env, g)
        other = next(p for p in g.workers(WORKER_COMPONENT) if p != last)
        other_wake = ((await get_ws(env.api, other)) or {})["status"].get("lastWake", {}).get("id")
        answers = await asyncio.gather(env.fe.chat(PROMPT), env.fe.chat(PROMPT))
        assert all(a.status == 200 and a.text == reference for a in answers), [a.body for a in answers]
        assert {a.worker_id for a in answers} == {await instance_id(env, last)}
        woke = await wait_ws(env, last, "its wake verified", verified_after(None), timeout=120)
        assert woke["status"]["lastWake"]["trigger"] == "request", woke["status"]["lastWake"]
        ws = await get_ws(env.api, other)
        assert ws is not None and asleep(ws), "the second worker woke: demand 2 needs one at 4 per worker"
        assert ws["status"].get("lastWake", {}).get("id") == other_wake
