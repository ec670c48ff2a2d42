"""A worker asleep for the whole of tests/integration/node (six minutes at the least) under Dynamo's own
liveness settings, then ``helm upgrade`` of the agent and the wake by the agent's next pod
(longsleep.py: the graph, the sleep and the looks; node/conftest.py starts it with the package and
orders this test last in it, so the sleep runs while the other suites use the node).
"""

from __future__ import annotations

import copy

import pytest
from controllerenv import Load, cond, events_for, get_ws, verified_after
from longsleep import ASLEEP_S, LIVENESS, LongSleep
from realnodecycle import override, ready_is, same_pod, wait_ws
from realnodeenv import WORKER_COMPONENT, Env, upgrade

from dynsnap.k8s.client import Obj
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv.cluster import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.last_in_package]


async def _agent_pod(env: Env) -> Obj:
    pods = [p for p in await env.chart_pods("agent") if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


async def test_asleep_through_the_package_under_dynamos_liveness_settings_then_a_helm_upgrade_and_the_wake(
        env: Env, long_sleep: LongSleep) -> None:
    """Tier snapshot, asleep from the package's start (at least six minutes) with the example's liveness
    probe (/live on the entrypoint every 5 s, failureThreshold 1: one failed probe restarts the container),
    while the other suites deploy, capture, wake and restart the controller on the node: at every look
    (5 s) kubelet reports the same container, running, never restarted, not Ready (the gate), its PID 1
    the same process, the WorkerSnapshot asleep on its capture; no liveness failure and no kill in the
    pod's Events. Then ``helm upgrade`` of the agent rolls its pod, and the next agent wakes the worker in
    place, verified by pinned requests, while unpinned requests served by its peer never fail."""
    s, w = long_sleep, long_sleep.worker
    example = next(c for c in s.graph.dgd["spec"]["components"] if c["name"] == WORKER_COMPONENT)
    main = next(c for c in example["podTemplate"]["spec"]["containers"] if c["name"] == "main")
    assert {k: main["livenessProbe"][k] for k in LIVENESS} == LIVENESS
    await s.remaining()
    await s.stop_looking()
    assert len(s.looks) >= ASLEEP_S / 5 * 0.9, f"{len(s.looks)} looks in {ASLEEP_S:.0f} s or more"
    assert not s.wrong, s.wrong[:10]

    load = Load(s.fe, concurrency=1, pause=1.0, max_tokens=2)
    load.start()
    try:
        old = await _agent_pod(env)
        values = copy.deepcopy(env.values)
        values["agent"].setdefault("podAnnotations", {})["dynsnap.test/upgraded"] = "1"
        await upgrade(env, values)
        new = await _agent_pod(env)
        assert new["metadata"]["uid"] != old["metadata"]["uid"], "helm upgrade rolled the agent's pod"
        before = (((await get_ws(env.api, w)) or {}).get("status") or {}).get("lastWake", {}).get("id")
        await override(env, w, "active")
        woken = await wait_ws(env, w, "woken and verified", verified_after(before))
    finally:
        await load.stop()
    assert load.results and not load.failures(), load.failures()[:5]
    wake = woken["status"]["lastWake"]
    assert wake["ok"] is True and wake["tier"] == "snapshot", wake
    v = woken["status"]["controller"]["verification"]
    dwm = await env.api.get(R.DWMS, w.name, namespace=w.namespace)
    assert v["ok"] is True and v["answered"] == v["requests"] == 3 and v["workerId"] == instance_id_from_dwm(dwm)
    verified = cond(woken, "Verified")
    assert verified is not None and verified["status"] == "True" and verified["reason"] == "Verified"
    await wait_for(f"{w.name} Ready again", lambda: ready_is(env, w, True), timeout=60, interval=0.5)
    await same_pod(env, w, s.first)
    killed = [e for e in await events_for(env.api, w.namespace, w.name)
              if (e.get("regarding") or {}).get("uid") == w.uid
              and (e.get("reason") == "Killing" or "Liveness probe failed" in (e.get("note") or ""))]
    assert not killed, killed
    now_agent = await _agent_pod(env)  # the node's only agent since the upgrade: the wake was its own
    assert now_agent["metadata"]["name"] == new["metadata"]["name"] and now_agent["status"]["containerStatuses"][0][
        "restartCount"] == 0, now_agent["status"]
    print(f"\nasleep {len(s.looks) * 5:.0f} s or so under /live every 5 s: {len(s.looks)} looks, the same container, "
          f"restartCount {s.first.restart_count}; woken by {new['metadata']['name']}")
