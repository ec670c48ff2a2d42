"""Tier ``engine`` (issue 21) on the real node (kubelet, containerd, runc; dynsnap installed by ``helm
install``: realnodeenv.py): workers put to sleep and woken by their engine's own routes on the
worker's system port (vLLM's ``control/sleep`` / ``control/wake_up``), with the same policy, planner,
quiesce and pinned verification as the other tiers; examples/dgd/agg.yaml and disagg.yaml under the
local overlay.

The engine is the stand-in for vLLM (dynsnap/testenv/stub_engine.py, real_graph.Engine: a Dynamo 1.6.1
worker of our own on the stub CUDA driver, whose sleep unregisters its endpoint instance, copies its
weights to host and frees them and its KV pool on the device, and whose wake allocates again, copies
back and registers again, as vLLM's level 1 does). The controller and the agent (pods of the chart)
and the frontend are the real ones. The agent's bound on a route is the shared install's
``agent.engineRouteTimeout`` (realnodeenv.SHARED_VALUES).

- an aggregated graph and a disaggregated one, each captured to min-active and woken by load, every
  wake verified by pinned requests, the device memory freed while asleep; kubelet's facts after: the
  same container, never restarted, and the driver never asked to checkpoint it;
- a route that fails (the engine answers an error) and one that hangs (never answers): named
  (EngineRouteFailed, EngineRouteTimeout) and bounded, the worker back in serving;
- a worker whose engine has no routes: refused before anything changes (EngineRoutesMissing), put
  back into serving and not asked again; with tier auto the same worker is captured with suspend.
"""

from __future__ import annotations

from typing import Any

import pytest
from controllerenv import Load, asleep, get_ws, policy, set_override, verified_after, wait_ws
from realnodeenv import SHARED_VALUES, WORKER_COMPONENT, Env, component_policy, deployed, edit_dgd
from realnodefacts import container_procs

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.runtime import procfs
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.dynsnap_parts import NSKEY_SHIFT
from dynsnap.testenv.real_graph import Engine, Graph, NodePod, kubelet_facts

pytestmark = pytest.mark.cluster

GIB = 0.25  # each engine's weights, and twice that of a never-written KV pool: what a sleep frees
KV_GIB = 0.5
ROUTE_TIMEOUT = SHARED_VALUES["agent"]["engineRouteTimeout"]
DISAGG = chart_node.ROOT / "examples" / "dgd" / "disagg.yaml"
ROLES = ("prefill", "decode")  # the example's component names, and their types


def agg(env: Env, tier: str, *extra: str, **pol: Any) -> Obj:
    """examples/dgd/agg.yaml: a frontend and two engine workers, ``tier``, one of them kept awake."""
    return chart_node.example_body(env, name=f"eng-{tier}", engine=Engine(gib=GIB, kv_gib=KV_GIB, extra=extra),
                                   policy=policy(enabled=True, idle_after="3s", tier=tier, min_active=1,
                                                 wake_at_inflight=1, **pol))


def disagg(env: Env) -> Obj:
    """examples/dgd/disagg.yaml: two prefill and two decode engine workers, each component kept to one."""
    body = chart_node.example_body(env, example=DISAGG, name="eng-disagg", engine=Engine(gib=GIB, kv_gib=KV_GIB),
                                   policy=policy(enabled=True, idle_after="3s", tier="engine", wake_at_inflight=1))
    for role in ROLES:
        component_policy(body, role, policy(min_active=1))
    return body


async def _asleep(env: Env, g: Graph, component: str) -> list[NodePod]:
    return [p for p in g.workers(component) if asleep(await get_ws(env.api, p))]


async def _one_asleep(env: Env, g: Graph, component: str = WORKER_COMPONENT) -> NodePod:
    async def one() -> bool:
        return len(await _asleep(env, g, component)) == 1
    await wait_for(f"one {component} asleep", one, timeout=180, interval=0.5)
    return (await _asleep(env, g, component))[0]


def _freed(ws: Obj) -> int:
    return sum(max(g["freeAfter"] - g["freeBefore"], 0) for g in ws["status"]["lastCapture"].get("gpus") or [])


async def _identity(env: Env, pod: NodePod) -> tuple[str, str, int, str, int]:
    """Pod UID, DWM UID, instance id, and kubelet's container id and restartCount."""
    p = await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    dwm = await env.api.get(R.DWMS, pod.name, namespace=pod.namespace)
    k = await kubelet_facts(env.api, pod)
    return p["metadata"]["uid"], dwm["metadata"]["uid"], instance_id_from_dwm(dwm), k.container_id, k.restart_count


async def _never_checkpointed(env: Env, g: Graph) -> None:
    """The driver's state of every process of the graph's pods is running (0): the engine slept, not the
    driver (the package's other graphs, the long sleep's, may hold checkpointed processes of their own)."""
    inodes = set()
    for ps in g.pods.values():
        for p in (p for p in ps if p.uid != g.frontend.uid):  # the worker pods (under the entrypoint)
            ns = procfs.pid_ns(container_procs(p.uid, (await kubelet_facts(env.api, p)).container_id).entrypoint)
            assert ns is not None, p.name
            inodes.add(ns)
    mine = {k: s for k, s in env.driver.states().items() if k >> NSKEY_SHIFT in inodes}
    assert all(s == 0 for s in mine.values()), mine


async def _woken_by_load(env: Env, wakes: dict[NodePod, str | None]) -> dict[NodePod, Obj]:
    """Load through the frontend until each of ``wakes`` (pod -> its last wake id before) is woken and
    verified; no request failed."""
    assert env.fe is not None
    burst = Load(env.fe, concurrency=6, max_tokens=16)
    burst.start()
    try:
        woken = {p: await wait_ws(env, p, "woken and verified", verified_after(before), timeout=180)
                 for p, before in wakes.items()}
    finally:
        await burst.stop()
    assert not burst.failures(), burst.failures()[:5]
    return woken


async def test_an_aggregated_graph_sleeps_through_its_engines_routes_and_wakes_verified(env: Env) -> None:
    async with deployed(env, agg(env, "engine")) as g:
        ids = {p.name: await _identity(env, p) for p in g.workers(WORKER_COMPONENT)}
        sleeper = await _one_asleep(env, g)
        ws = await get_ws(env.api, sleeper)
        assert ws is not None
        cap = ws["status"]["lastCapture"]
        assert cap["tier"] == "engine" and cap["ok"] is True
        assert [s["name"] for s in cap["steps"]] == ["quiesce", "engine-sleep"], cap["steps"]
        # The engine freed its weights and its pool on the (stub) device: what the agent measured around it.
        assert _freed(ws) >= int((GIB + KV_GIB) * (1 << 30)) * 0.99, cap.get("gpus")
        await _never_checkpointed(env, g)

        woken = (await _woken_by_load(env, {sleeper: ws["status"].get("lastWake", {}).get("id")}))[sleeper]
        wake = woken["status"]["lastWake"]
        assert wake["tier"] == "engine" and [s["name"] for s in wake["steps"]] == ["wake", "engine-wake"], wake
        v = woken["status"]["controller"]["verification"]
        assert v["ok"] is True and v["answered"] == v["requests"] == 3, v
        # Same pod, same DWM object, same instance id: the engine's re-registration rewrote the DWM's
        # content, not the object (docs/CONTROLLER.md, "Tier engine"); kubelet's same container, never
        # restarted.
        for p in g.workers(WORKER_COMPONENT):
            assert await _identity(env, p) == ids[p.name], p.name
        assert ids[sleeper.name][4] == 0
        assert v["workerId"] == ids[sleeper.name][2]
        await _never_checkpointed(env, g)


async def test_a_disaggregated_graph_sleeps_each_component_through_its_routes(env: Env) -> None:
    async with deployed(env, disagg(env)) as g:
        ids = {p.name: await _identity(env, p) for role in ROLES for p in g.workers(role)}
        sleeping = {role: await _one_asleep(env, g, role) for role in ROLES}
        before = {}
        for p in sleeping.values():
            ws = await get_ws(env.api, p)
            assert ws is not None and ws["status"]["lastCapture"]["tier"] == "engine", p.name
            before[p] = ws["status"].get("lastWake", {}).get("id")
        woken = await _woken_by_load(env, before)
        assert woken[sleeping["prefill"]]["status"]["controller"]["verification"]["headers"] == [
            P.HEADER_PREFILL_INSTANCE_ID]
        assert woken[sleeping["decode"]]["status"]["controller"]["verification"]["headers"] == [
            P.HEADER_WORKER_INSTANCE_ID, P.HEADER_PREFILL_INSTANCE_ID]
        for role in ROLES:
            for p in g.workers(role):
                assert await _identity(env, p) == ids[p.name], p.name
        await _never_checkpointed(env, g)


def _error_of(reason: str) -> Any:
    def check(ws: Obj | None) -> bool:
        err = ((ws or {}).get("status") or {}).get("lastError") or {}
        return bool(err.get("reason") == reason)
    return check


async def _failed_with(env: Env, g: Graph, reason: str) -> NodePod:
    async def failed() -> NodePod | None:
        for p in g.workers(WORKER_COMPONENT):
            if _error_of(reason)(await get_ws(env.api, p)):
                return p
        return None
    found: NodePod = await wait_for(f"a capture failing with {reason}", failed, timeout=120, interval=0.5)
    return found


async def _served_pinned(env: Env, pod: NodePod, prompt: str) -> None:
    """A request pinned to ``pod`` through the frontend, answered by it."""
    assert env.fe is not None
    wid = (await _identity(env, pod))[2]
    await env.fe.wait_routable(wid, timeout=120)
    r = await env.fe.chat(prompt, worker_id=wid)
    assert r.status == 200 and r.worker_id == wid, r.body


@pytest.mark.parametrize(("fault", "reason", "says"), [
    ("fail", "EngineRouteFailed", "answered HTTP 200: "),
    ("hang", "EngineRouteTimeout", f"no answer within {ROUTE_TIMEOUT:g} s"),
])
async def test_a_route_that_fails_or_hangs_is_named_bounded_and_the_worker_serves(
        env: Env, fault: str, reason: str, says: str) -> None:
    async with deployed(env, agg(env, "engine", f"--{fault}-route", "sleep")) as g:
        pod = await _failed_with(env, g, reason)
        ws = await get_ws(env.api, pod)
        assert ws is not None
        err = ws["status"]["lastError"]
        assert err["step"] == "engine-sleep" and says in err["message"], err
        # Held awake from here (the user's `dynsnap wake`), so the controller's next try cannot put it to
        # sleep before the request below: what it proves is the rollback, so no wake may come between.
        await set_override(env.api, pod, "active")
        # Rolled back (the wake route undoes a half sleep) and in serving again: a request pinned to it.
        await _served_pinned(env, pod, "after the fault")
        after = await get_ws(env.api, pod)
        assert after is not None
        assert after["status"]["lastCapture"]["id"] == ws["status"]["lastCapture"]["id"], "no capture since"
        assert (after["status"].get("lastWake") or {}).get("id") == (ws["status"].get("lastWake") or {}).get("id"), \
            "served by the rollback, not by a wake"
        assert (await kubelet_facts(env.api, pod)).restart_count == 0


async def test_a_worker_without_engine_routes_is_refused_and_auto_sleeps_it_with_suspend(env: Env) -> None:
    async with deployed(env, agg(env, "engine", "--no-routes")) as g:
        pod = await _failed_with(env, g, "EngineRoutesMissing")
        ws = await get_ws(env.api, pod)
        assert ws is not None
        err = ws["status"]["lastError"]
        assert err["step"] == "quiesce" and "each answered 404" in err["message"], err
        cap = ws["status"]["lastCapture"]
        assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce"], cap
        # Nothing changed: the worker is back in serving, and the refusal is not asked again.
        await _served_pinned(env, pod, "refused")
        # Tier auto (the user's `kubectl edit` of the graph): the same workers are captured by the driver
        # (suspend), the engine having no routes.
        await edit_dgd(env, g, lambda d: d["metadata"]["annotations"].update({P.ANN_TIER: "auto"}))
        sleeper = await _one_asleep(env, g)
        ws = await get_ws(env.api, sleeper)
        assert ws is not None and ws["spec"]["tier"] == "auto"
        assert ws["status"]["lastCapture"]["tier"] == "suspend", ws["status"]["lastCapture"]
        assert [s["name"] for s in ws["status"]["lastCapture"]["steps"]] == ["quiesce", "save", "settle-suspended"]
