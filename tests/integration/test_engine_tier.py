"""Tier ``engine`` (issue 21): workers put to sleep and woken by their engine's own routes on the
worker's system port (vLLM's ``control/sleep`` / ``control/wake_up``), with the same policy, planner,
quiesce and pinned verification as the other tiers.

The engine is the stand-in for vLLM (dynsnap/testenv/stub_engine.py: a Dynamo 1.6.1 worker of our own
on the stub CUDA driver, whose sleep unregisters its endpoint instance, copies its weights to host and
frees them and its KV pool on the device, and whose wake allocates again, copies back and registers
again, as vLLM's level 1 does). The controller, the agents and the frontend are the real ones.

- an aggregated graph and a disaggregated one, each captured to min-active and woken by load, every
  wake verified by pinned requests, the device memory freed while asleep and back after;
- a route that fails (the engine answers an error) and one that hangs (never answers): named
  (EngineRouteFailed, EngineRouteTimeout) and bounded, the worker back in serving;
- a worker whose engine has no routes: refused before anything changes (EngineRoutesMissing), put
  back into serving and not asked again; with tier auto the same worker is captured with suspend.

Sandbox, why: not yet moved to the real node (the stand-in engine runs there already:
node/test_wake_on_request.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from controllerenv import CtlEnv, Load, asleep, get_ws, policy, running, verified_after, wait_ws

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, RunningPod, wait_for
from dynsnap.testenv.dynsnap_parts import StubDriver, engine_worker_component

pytestmark = pytest.mark.cluster

GIB = 0.25  # each engine's weights, and twice that of a never-written KV pool: what a sleep frees
KV_GIB = 0.5
AGENT_ARGS = ["--engine-route-timeout", "6"]


def agg(tier: str, *, engine_args: list[str] | None = None, **pol: Any) -> Any:
    def make(driver: StubDriver) -> Obj:
        w = engine_worker_component("worker", replicas=2, driver=driver, gib=GIB, kv_gib=KV_GIB,
                                    engine_args=engine_args)
        body = D.dgd(f"eng-{tier}", [D.frontend_component(), w])
        body["metadata"]["annotations"] = policy(enabled=True, idle_after="3s", tier=tier, min_active=1,
                                                 wake_at_inflight=1, **pol)
        return body
    return make


def disagg(driver: StubDriver) -> Obj:
    comps = []
    for role in ("prefill", "decode"):
        c = engine_worker_component(role, replicas=2, driver=driver, mode=role, sub=role, gib=GIB, kv_gib=KV_GIB)
        c["annotations"] = policy(min_active=1)
        comps.append(c)
    body = D.dgd("eng-disagg", [D.frontend_component(router_mode="kv"), *comps])
    body["metadata"]["annotations"] = policy(enabled=True, idle_after="3s", tier="engine", wake_at_inflight=1)
    return body


async def _asleep(env: CtlEnv, component: str) -> list[RunningPod]:
    return [p for p in env.graph.workers(component) if asleep(await get_ws(env.api, p))]


async def _one_asleep(env: CtlEnv, component: str) -> RunningPod:
    async def one() -> bool:
        return len(await _asleep(env, component)) == 1
    await wait_for(f"one {component} asleep", one, timeout=180, interval=0.5)
    return (await _asleep(env, component))[0]


def _freed(ws: Obj) -> int:
    return sum(max(g["freeAfter"] - g["freeBefore"], 0) for g in ws["status"]["lastCapture"].get("gpus") or [])


async def _identity(env: CtlEnv, pod: RunningPod) -> tuple[str, str, int]:
    p = await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    dwm = await env.api.get(R.DWMS, pod.name, namespace=pod.namespace)
    return p["metadata"]["uid"], dwm["metadata"]["uid"], instance_id_from_dwm(dwm)


async def _woken_by_load(env: CtlEnv, pod: RunningPod, before: str | None) -> Obj:
    burst = Load(env.fe, concurrency=6, max_tokens=16)
    burst.start()
    try:
        ws = await wait_ws(env, pod, "woken and verified", verified_after(before), timeout=180)
    finally:
        await burst.stop()
    assert not burst.failures(), burst.failures()[:5]
    return ws


async def test_an_aggregated_graph_sleeps_through_its_engines_routes_and_wakes_verified(cluster: LocalCluster) -> None:
    async with running(cluster, agg("engine"), agent_args=AGENT_ARGS) as env:
        ids = {p.name: await _identity(env, p) for p in env.graph.workers("worker")}
        sleeper = await _one_asleep(env, "worker")
        ws = await get_ws(env.api, sleeper)
        assert ws is not None
        cap = ws["status"]["lastCapture"]
        assert cap["tier"] == "engine" and cap["ok"] is True
        assert [s["name"] for s in cap["steps"]] == ["quiesce", "engine-sleep"], cap["steps"]
        # The engine freed its weights and its pool on the (stub) device: what the agent measured around it.
        assert _freed(ws) >= int((GIB + KV_GIB) * (1 << 30)) * 0.99, cap.get("gpus")
        # Its processes were never checkpointed: the engine slept, not the driver.
        assert all(s == 0 for s in env.driver.states().values()), env.driver.states()
        before = ws["status"].get("lastWake", {}).get("id")

        woken = await _woken_by_load(env, sleeper, before)
        wake = woken["status"]["lastWake"]
        assert wake["tier"] == "engine" and [s["name"] for s in wake["steps"]] == ["wake", "engine-wake"], wake
        v = woken["status"]["controller"]["verification"]
        assert v["ok"] is True and v["answered"] == v["requests"] == 3, v
        # Same pod, same DWM object, same instance id: the engine's re-registration rewrote the DWM's
        # content, not the object (docs/CONTROLLER.md, "Tier engine").
        assert await _identity(env, sleeper) == ids[sleeper.name]
        assert v["workerId"] == ids[sleeper.name][2]


async def test_a_disaggregated_graph_sleeps_each_component_through_its_routes(cluster: LocalCluster) -> None:
    async with running(cluster, disagg, agent_args=AGENT_ARGS) as env:
        sleeping = {role: await _one_asleep(env, role) for role in ("prefill", "decode")}
        before = {}
        for role, p in sleeping.items():
            ws = await get_ws(env.api, p)
            assert ws is not None and ws["status"]["lastCapture"]["tier"] == "engine"
            before[role] = ws["status"].get("lastWake", {}).get("id")
        burst = Load(env.fe, concurrency=6, max_tokens=16)
        burst.start()
        try:
            woken = {role: await wait_ws(env, p, "woken and verified", verified_after(before[role]), timeout=180)
                     for role, p in sleeping.items()}
        finally:
            await burst.stop()
        assert not burst.failures(), burst.failures()[:5]
        assert woken["prefill"]["status"]["controller"]["verification"]["headers"] == [P.HEADER_PREFILL_INSTANCE_ID]
        assert woken["decode"]["status"]["controller"]["verification"]["headers"] == [
            P.HEADER_WORKER_INSTANCE_ID, P.HEADER_PREFILL_INSTANCE_ID]


def _error_of(reason: str) -> Any:
    def check(ws: Obj | None) -> bool:
        err = ((ws or {}).get("status") or {}).get("lastError") or {}
        return bool(err.get("reason") == reason)
    return check


@pytest.mark.parametrize(("fault", "reason", "says"), [
    ("fail", "EngineRouteFailed", "answered HTTP 200: "),
    ("hang", "EngineRouteTimeout", "no answer within 6 s"),
])
async def test_a_route_that_fails_or_hangs_is_named_bounded_and_the_worker_serves(
        cluster: LocalCluster, tmp_path: Path, fault: str, reason: str, says: str) -> None:
    faults = tmp_path / "faults"
    faults.write_text(f"{fault} sleep\n")
    async with running(cluster, agg("engine", engine_args=["--fault-file", str(faults)]),
                       agent_args=AGENT_ARGS) as env:
        pods = env.graph.workers("worker")

        async def failed() -> RunningPod | None:
            for p in pods:
                if _error_of(reason)(await get_ws(env.api, p)):
                    return p
            return None
        pod = await wait_for(f"a capture failing with {reason}", failed, timeout=120, interval=0.5)
        ws = await get_ws(env.api, pod)
        assert ws is not None
        err = ws["status"]["lastError"]
        assert err["step"] == "engine-sleep" and says in err["message"], err
        # Held awake from here (the user's `dynsnap wake`), so the controller's next try cannot put it to
        # sleep before the request below: what it proves is the rollback, so no wake may come between.
        await env.api.merge_patch(R.PODS, pod.name, {"metadata": {"annotations": {P.ANN_DESIRED_STATE: "active"}}},
                                  namespace=pod.namespace)
        # Rolled back (the wake route undoes a half sleep) and in serving again: a request pinned to it.
        wid = (await _identity(env, pod))[2]
        await env.fe.wait_routable(wid, timeout=120)
        r = await env.fe.chat("after the fault", worker_id=wid)
        assert r.status == 200 and r.worker_id == wid, r.body
        after = await get_ws(env.api, pod)
        assert after is not None
        assert after["status"]["lastCapture"]["id"] == ws["status"]["lastCapture"]["id"], "no capture since"
        assert (after["status"].get("lastWake") or {}).get("id") == (ws["status"].get("lastWake") or {}).get("id"), \
            "served by the rollback, not by a wake"


async def test_a_worker_without_engine_routes_is_refused_and_auto_sleeps_it_with_suspend(cluster: LocalCluster) -> None:
    async with running(cluster, agg("engine", engine_args=["--no-routes"]), agent_args=AGENT_ARGS) as env:
        pods = env.graph.workers("worker")

        async def refused() -> RunningPod | None:
            for p in pods:
                ws = await get_ws(env.api, p)
                if _error_of("EngineRoutesMissing")(ws):
                    return p
            return None
        pod = await wait_for("a capture refused for its missing routes", refused, timeout=120, interval=0.5)
        ws = await get_ws(env.api, pod)
        assert ws is not None
        err = ws["status"]["lastError"]
        assert err["step"] == "quiesce" and "each answered 404" in err["message"], err
        cap = ws["status"]["lastCapture"]
        assert cap["ok"] is False and [s["name"] for s in cap["steps"]] == ["quiesce"], cap
        # Nothing changed: the worker is back in serving, and the refusal is not asked again.
        wid = (await _identity(env, pod))[2]
        await env.fe.wait_routable(wid, timeout=120)
        r = await env.fe.chat("refused", worker_id=wid)
        assert r.status == 200 and r.worker_id == wid, r.body
        # Tier auto: the same workers are captured by the driver (suspend), the engine having no routes.
        name = env.graph.dgd["metadata"]["name"]
        dgd = await env.api.get(R.DGDS, name, namespace=pod.namespace)
        ann = {**dgd["metadata"]["annotations"], P.ANN_TIER: "auto"}
        await env.api.merge_patch(R.DGDS, name, {"metadata": {"annotations": ann}},
                                  namespace=pod.namespace)
        sleeper = await _one_asleep(env, "worker")
        ws = await get_ws(env.api, sleeper)
        assert ws is not None and ws["spec"]["tier"] == "auto"
        assert ws["status"]["lastCapture"]["tier"] == "suspend", ws["status"]["lastCapture"]
        assert [s["name"] for s in ws["status"]["lastCapture"]["steps"]] == ["quiesce", "save", "settle-suspended"]
