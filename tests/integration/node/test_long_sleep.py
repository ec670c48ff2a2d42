"""A worker asleep for the whole of tests/integration/node (six minutes at the least) under Dynamo's own
liveness settings, then ``helm upgrade`` of the agent and the wake by the agent's next pod
(longsleep.py: the graph, the sleep and the looks; node/conftest.py starts it with the package and
orders this test last in it, so the sleep runs while the other suites use the node).
"""

from __future__ import annotations

import copy

import pytest
from controllerenv import Load, events_for, get_ws, verified_after
from longsleep import ASLEEP_S, LIVENESS, LongSleep
from realnodecycle import override, proven, same_pod, wait_ws
from realnodeenv import WORKER_COMPONENT, Env, chart_pod, upgrade

pytestmark = [pytest.mark.cluster, pytest.mark.last_in_package]


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
        old = await chart_pod(env, "agent")
        values = copy.deepcopy(env.values)
        values["agent"].setdefault("podAnnotations", {})["dynsnap.test/upgraded"] = "1"
        await upgrade(env, values)
        new = await chart_pod(env, "agent")
        assert new["metadata"]["uid"] != old["metadata"]["uid"], "helm upgrade rolled the agent's pod"
        before = (((await get_ws(env.api, w)) or {}).get("status") or {}).get("lastWake", {}).get("id")
        await override(env, w, "active")
        woken = await wait_ws(env, w, "woken and verified", verified_after(before))
    finally:
        await load.stop()
    assert load.results and not load.failures(), load.failures()[:5]
    await proven(env, w, woken, "snapshot")
    await same_pod(env, w, s.first)
    killed = [e for e in await events_for(env.api, w.namespace, w.name)
              if (e.get("regarding") or {}).get("uid") == w.uid
              and (e.get("reason") == "Killing" or "Liveness probe failed" in (e.get("note") or ""))]
    assert not killed, killed
    now_agent = await chart_pod(env, "agent")  # the node's only agent since the upgrade: the wake was its own
    assert now_agent["metadata"]["name"] == new["metadata"]["name"] and now_agent["status"]["containerStatuses"][0][
        "restartCount"] == 0, now_agent["status"]
    print(f"\nasleep {len(s.looks) * 5:.0f} s or so under /live every 5 s: {len(s.looks)} looks, the same container, "
          f"restartCount {s.first.restart_count}; woken by {new['metadata']['name']}")
