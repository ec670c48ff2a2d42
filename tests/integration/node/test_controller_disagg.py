"""The controller on a disaggregated graph, examples/dgd/disagg.yaml on the real node (kubelet,
containerd, runc; dynsnap installed by ``helm install``: realnodeenv.py) under the local overlay,
its workers Dynamo's mocker in their role: a prefill component and a decode component, each opted
in with its own policy (``min-active: 1``, two replicas), are each captured down to one worker when
idle and woken by load through the frontend (``--router-mode kv``, as the example has it). Every
wake is verified with the headers its role needs: a prefill worker pinned with
``x-dynamo-prefill-instance-id`` alone, a decode worker with both ``x-dynamo-worker-instance-id``
(itself) and ``x-dynamo-prefill-instance-id`` (a serving prefill worker), and every answer names
both. kubelet's facts after: every worker's container the same one, never restarted."""

from __future__ import annotations

from typing import Any

import pytest
from controllerenv import Load, asleep, events_for, get_ws, policy, verified_after, wait_ws
from realnodeenv import Env, ServingLooks, component_policy, deployed, instance_id

from dynsnap.k8s.client import Obj
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import Graph, NodePod, kubelet_facts

pytestmark = pytest.mark.cluster

ROLES = ("prefill", "decode")  # the example's component names, and their types
EXAMPLE = chart_node.ROOT / "examples" / "dgd" / "disagg.yaml"



def graph(env: Env, tier: str) -> Obj:
    body = chart_node.example_body(env, example=EXAMPLE, name=f"ctl-disagg-{tier}", speedup_ratio=1, policy=policy(
        enabled=True, idle_after="3s", tier=tier, wake_at_inflight=1))
    for role in ROLES:  # each component its own limit
        component_policy(body, role, policy(min_active=1, verify_requests=3))
    return body


def status_fields_of(ws: Obj, manager: str) -> Obj:
    """The status fields ``manager`` owns on the WorkerSnapshot (its server-side apply record)."""
    owned: Obj = {}
    for m in ws["metadata"].get("managedFields") or []:
        if m.get("manager") == manager and m.get("subresource") == "status":
            owned.update((m.get("fieldsV1") or {}).get("f:status") or {})
    return owned


def verified_or_failing(since: str | None) -> Any:
    """verified_after(since), and a failed verification of that wake fails the wait at once."""
    ok = verified_after(since)

    def check(ws: Obj | None) -> bool:
        # Gone: its pod was deleted, as a failed wake's fallback does (the verdict may not be seen first).
        assert ws is not None, "the WorkerSnapshot is gone"
        st = ws.get("status") or {}
        v = (st.get("controller") or {}).get("verification") or {}
        wake = (st.get("lastWake") or {}).get("id")
        assert not (wake and wake != since and v.get("wakeId") == wake and v.get("ok") is False), v
        return ok(ws)
    return check


async def _asleep_in(env: Env, g: Graph, role: str) -> list[NodePod]:
    return [p for p in g.workers(role) if asleep(await get_ws(env.api, p))]


@pytest.mark.parametrize("tier", ["suspend", "snapshot"])
async def test_prefill_and_decode_each_sleep_to_min_active_and_wake_verified_with_their_headers(
        env: Env, tier: str) -> None:
    async with deployed(env, graph(env, tier)) as g:
        assert env.fe is not None
        ids = {p.name: await instance_id(env, p) for role in ROLES for p in g.workers(role)}
        prefill_ids = {ids[p.name] for p in g.workers("prefill")}
        first = {p.name: await kubelet_facts(env.api, p) for role in ROLES for p in g.workers(role)}

        # Idle: each component is captured down to its own min-active, never below it.
        async def one_asleep_in_each() -> bool:
            return all([len(await _asleep_in(env, g, role)) == 1 for role in ROLES])
        await wait_for("one worker of each component asleep", one_asleep_in_each, timeout=180, interval=0.5)
        sleeping = {role: (await _asleep_in(env, g, role))[0] for role in ROLES}
        for role in ROLES:
            awake = [p for p in g.workers(role) if p != sleeping[role]]
            assert len(awake) == 1 and not asleep(await get_ws(env.api, awake[0])), role
        before = {role: ((await get_ws(env.api, p)) or {})["status"].get("lastWake", {}).get("id")
                  for role, p in sleeping.items()}

        # Load: demand over one worker's share in each component wakes both sleepers.
        looks = ServingLooks(env, [p for role in ROLES for p in g.workers(role)])  # beside any failure
        looks.start()
        burst = Load(env.fe, concurrency=6, max_tokens=60)
        burst.start()
        try:
            woken = {role: await wait_ws(env, p, "woken and verified", verified_or_failing(before[role]), timeout=180)
                     for role, p in sleeping.items()}
        finally:
            await burst.stop()
            await looks.stop()
        assert not burst.failures(), "\n".join(f"{f}\n{looks.around(f[0])}" for f in burst.failures()[:5])
        assert len(burst.results) >= 6  # the load really ran

        # A prefill worker is pinned with the prefill header alone and named as the answer's prefill.
        pre = sleeping["prefill"]
        v = woken["prefill"]["status"]["controller"]["verification"]
        assert v["headers"] == [P.HEADER_PREFILL_INSTANCE_ID], v
        assert v["prefillId"] == ids[pre.name] and v.get("workerId") is None, v
        assert v["requests"] == 3 and v["answered"] == 3, v

        # A decode worker is pinned with both: itself, and a prefill worker that serves; both ids checked.
        dec = sleeping["decode"]
        v = woken["decode"]["status"]["controller"]["verification"]
        assert v["headers"] == [P.HEADER_WORKER_INSTANCE_ID, P.HEADER_PREFILL_INSTANCE_ID], v
        assert v["workerId"] == ids[dec.name], v
        assert v["prefillId"] in prefill_ids, v
        assert v["requests"] == 3 and v["answered"] == 3, v

        for role, p in sleeping.items():
            ws = woken[role]
            verified = next(c for c in ws["status"]["conditions"] if c["type"] == "Verified")
            assert verified["status"] == "True" and verified["reason"] == "Verified", (role, verified)
            assert ws["status"]["lastWake"]["tier"] == tier and ws["status"]["lastWake"]["ok"] is True
            ident = ws["status"]["controller"]["identity"]
            dwm = await env.api.get(R.DWMS, p.name, namespace=p.namespace)
            assert ident["podUID"] == p.uid and ident["dwmUID"] == dwm["metadata"]["uid"]
            assert ident["instanceId"] == ids[p.name] == instance_id_from_dwm(dwm)
            reasons = {e["reason"] for e in await events_for(env.api, p.namespace, p.name)}
            assert {"Quiescing", "CaptureRequested", "WakeRequested", "Verified"} <= reasons, (role, reasons)
            # The controller's part of the status is the controller's alone: the agent applied its status
            # many times after the controller wrote its part, and never took any of it over.
            agent = status_fields_of(ws, P.AGENT_FIELD_MANAGER)
            ctl = status_fields_of(ws, P.FIELD_MANAGER)
            assert "f:state" in agent and "f:controller" in ctl, (agent.keys(), ctl.keys())
            assert "f:controller" not in agent, agent.keys()
            for ctype in P.CONTROLLER_CONDITIONS:
                key = f'k:{{"type":"{ctype}"}}'
                assert key in ctl.get("f:conditions", {}) and key not in agent.get("f:conditions", {}), (ctype, agent)

        # All four serve again: requests pinned with both headers reach every decode/prefill pair.
        for d in g.workers("decode"):
            for pf in g.workers("prefill"):
                await env.fe.wait_routable(ids[d.name], prefill_id=ids[pf.name])
                r = await env.fe.chat("after", worker_id=ids[d.name], prefill_id=ids[pf.name], max_tokens=2)
                assert r.status == 200, r.body
                assert (r.worker_id, r.prefill_worker_id) == (ids[d.name], ids[pf.name])
        # kubelet's own account: every worker's container the same one throughout, never restarted.
        for role in ROLES:
            for p in g.workers(role):
                now = await kubelet_facts(env.api, p)
                assert (now.container_id, now.restart_count, now.running) == (first[p.name].container_id, 0, True), now
