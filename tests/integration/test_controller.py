"""The controller on its own: an aggregated graph of three mocker workers opted in with
``min-active: 1`` goes idle and is captured down to one worker, load through the frontend wakes
the others, and every wake is verified by requests pinned to the woken worker; not one request
sent through the frontend during the whole cycle fails. Both tiers. The controller and the
agents run as their own processes under their shipped RBAC."""

from __future__ import annotations

import pytest
from controllerenv import CtlEnv, Load, asleep, events_for, get_ws, policy, running, verified_after, wait_ws

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.dynsnap_parts import StubDriver

pytestmark = pytest.mark.cluster


def graph(tier: str) -> object:
    def make(driver: StubDriver) -> Obj:
        worker = D.mocker_component("worker", replicas=3, dynsnap=True, speedup_ratio=1,
                                    env={"LD_PRELOAD": str(driver.libcuda)})
        worker["annotations"] = policy(min_active=1, verify_requests=3)
        body = D.dgd(f"ctl-{tier}", [D.frontend_component(), worker])
        body["metadata"]["annotations"] = policy(enabled=True, idle_after="3s", tier=tier, wake_at_inflight=1)
        return body
    return make


async def _count_asleep(env: CtlEnv) -> int:
    return sum([asleep(await get_ws(env.api, p)) for p in env.graph.workers("worker")])


@pytest.mark.parametrize("tier", ["suspend", "snapshot"])
async def test_idle_workers_sleep_to_min_active_and_load_wakes_them_verified(cluster: LocalCluster,
                                                                              tier: str) -> None:
    async with running(cluster, graph(tier)) as env:  # type: ignore[arg-type]
        workers = env.graph.workers("worker")
        uids = {p.name: p.uid for p in workers}
        trickle = Load(env.fe, concurrency=1, pause=2.5, max_tokens=2)
        trickle.start()
        try:
            # Idle: captured down to min-active (one stays serving, and serves the trickle).
            async def two_asleep() -> bool:
                return await _count_asleep(env) == 2
            await wait_for("two of three workers asleep", two_asleep, timeout=180, interval=0.5)
            sleeping = [p for p in workers if asleep(await get_ws(env.api, p))]
            awake = [p for p in workers if p not in sleeping]
            assert len(awake) == 1
            before = {p.name: ((await get_ws(env.api, p)) or {})["status"].get("lastWake", {}).get("id")
                      for p in sleeping}
            for p in sleeping:
                ws = await get_ws(env.api, p)
                assert ws is not None and ws["spec"]["tier"] == tier
                ident = ws["status"]["controller"]["identity"]
                assert ident["podUID"] == p.uid
                q = ws["status"]["controller"]["quiesce"]
                assert q["ok"] is True and [s["name"] for s in q["steps"]] == [
                    "gate", "endpoint-not-ready", "frontend-stopped-routing", "drained"]
            # Load: demand above one worker's share wakes both sleepers; each wake is proven.
            burst = Load(env.fe, concurrency=6, max_tokens=60)
            burst.start()
            try:
                for p in sleeping:
                    ws = await wait_ws(env, p, "woken and verified", verified_after(before[p.name]), timeout=180)
                    v = ws["status"]["controller"]["verification"]
                    dwm = await env.api.get(D.R.DWMS, p.name, namespace=p.namespace)
                    iid = instance_id_from_dwm(dwm)
                    assert v["requests"] == 3 and v["answered"] == 3, v
                    assert v["workerId"] == iid and v["headers"] == [P.HEADER_WORKER_INSTANCE_ID], v
                    assert dwm["metadata"]["uid"] == ws["status"]["controller"]["identity"]["dwmUID"]
                    assert ws["status"]["lastWake"]["tier"] == tier and ws["status"]["lastWake"]["ok"] is True
                    verified = next(c for c in ws["status"]["conditions"] if c["type"] == "Verified")
                    assert verified["status"] == "True" and verified["reason"] == "Verified"
            finally:
                await burst.stop()
            # The woken workers serve unpinned traffic again, under their old identity.
            for p in sleeping:
                live = await env.api.get(D.R.PODS, p.name, namespace=p.namespace)
                assert live["metadata"]["uid"] == uids[p.name]
            ids = {instance_id_from_dwm(await env.api.get(D.R.DWMS, p.name, namespace=p.namespace))
                   for p in workers}
            after = [await env.fe.chat(f"after {i}", max_tokens=2) for i in range(12)]
            assert all(r.status == 200 for r in after), [r.body for r in after if r.status != 200]
            assert {r.worker_id for r in after} == ids  # round robin over all three again
        finally:
            await trickle.stop()
        failures = trickle.failures() + burst.failures()
        assert not failures, failures[:5]
        assert len(trickle.results) >= 2 and len(burst.results) >= 6  # both loads really ran
        reasons = {e["reason"] for p in sleeping for e in await events_for(env.api, p.namespace, p.name)}
        assert {"Quiescing", "CaptureRequested", "WakeRequested", "Verified"} <= reasons, reasons
