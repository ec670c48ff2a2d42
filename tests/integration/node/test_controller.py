"""The controller on its own, on the real node (kubelet, containerd, runc; dynsnap installed by
``helm install``: realnodeenv.py): examples/dgd/agg.yaml with three mocker workers opted in with
``min-active: 1`` goes idle and is captured down to one worker, load through the frontend wakes
the others, and every wake is verified by requests pinned to the woken worker; not one request
sent through the frontend during the whole cycle fails, and kubelet reports every worker's
container the same one, never restarted. Both tiers."""

from __future__ import annotations

import pytest
from controllerenv import Load, asleep, events_for, get_ws, policy, verified_after, wait_ws
from realnodeenv import WORKER_COMPONENT, Env, ServingLooks, component_policy, deployed

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import Graph, kubelet_facts

pytestmark = pytest.mark.cluster



def graph(env: Env, tier: str) -> Obj:
    body = chart_node.example_body(env, name=f"ctl-{tier}", worker_replicas=3, speedup_ratio=1, policy=policy(
        enabled=True, idle_after="3s", tier=tier, wake_at_inflight=1))
    return component_policy(body, WORKER_COMPONENT, policy(min_active=1, verify_requests=3))


async def _count_asleep(env: Env, g: Graph) -> int:
    return sum([asleep(await get_ws(env.api, p)) for p in g.workers(WORKER_COMPONENT)])


@pytest.mark.parametrize("tier", ["suspend", "snapshot"])
async def test_idle_workers_sleep_to_min_active_and_load_wakes_them_verified(env: Env, tier: str) -> None:
    async with deployed(env, graph(env, tier)) as g:
        assert env.fe is not None
        workers = g.workers(WORKER_COMPONENT)
        uids = {p.name: p.uid for p in workers}
        first = {p.name: await kubelet_facts(env.api, p) for p in workers}
        looks = ServingLooks(env, workers)  # what kubelet and the EndpointSlices said, beside any failure
        looks.start()
        trickle = Load(env.fe, concurrency=1, pause=2.5, max_tokens=2)
        trickle.start()
        try:
            # Idle: captured down to min-active (one stays serving, and serves the trickle).
            async def two_asleep() -> bool:
                return await _count_asleep(env, g) == 2
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
                    dwm = await env.api.get(R.DWMS, p.name, namespace=p.namespace)
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
                live = await env.api.get(R.PODS, p.name, namespace=p.namespace)
                assert live["metadata"]["uid"] == uids[p.name]
            ids = {instance_id_from_dwm(await env.api.get(R.DWMS, p.name, namespace=p.namespace))
                   for p in workers}
            after = [await env.fe.chat(f"after {i}", max_tokens=2) for i in range(12)]
            assert all(r.status == 200 for r in after), [r.body for r in after if r.status != 200]
            assert {r.worker_id for r in after} == ids  # round robin over all three again
        finally:
            await trickle.stop()
            await looks.stop()
        failures = trickle.failures() + burst.failures()
        assert not failures, "\n".join(f"{f}\n{looks.around(f[0])}" for f in failures[:5])
        assert len(trickle.results) >= 2 and len(burst.results) >= 6  # both loads really ran
        reasons = {e["reason"] for p in sleeping for e in await events_for(env.api, p.namespace, p.name)}
        assert {"Quiescing", "CaptureRequested", "WakeRequested", "Verified"} <= reasons, reasons
        for p in workers:  # kubelet's own account: the same container throughout, never restarted
            now = await kubelet_facts(env.api, p)
            assert (now.container_id, now.restart_count, now.running) == (first[p.name].container_id, 0, True), now
