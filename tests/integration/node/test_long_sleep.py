"""A worker asleep for the whole of tests/integration/node (six minutes at the least) under Dynamo's own
liveness settings, then ``helm upgrade`` of the agent and the wake by the agent's next pod
(longsleep.py: the graph, the sleep and the looks; node/conftest.py starts it with the package and
orders this test last in it, so the sleep runs while the other suites use the node).
"""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime

import pytest
from controllerenv import Load, events_for, get_ws, verified_after
from longsleep import ASLEEP_S, LIVENESS, LongSleep, watched_since
from realnodecycle import override, proven, same_pod, wait_ws
from realnodeenv import NS, WORKER_COMPONENT, Env, chart_pod, upgrade

from dynsnap.testenv.cluster import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.last_in_package]


async def test_asleep_through_the_package_under_dynamos_liveness_settings_then_a_helm_upgrade_and_the_wake(
        env: Env, long_sleep: LongSleep) -> None:
    """Tier snapshot, asleep from the package's start (at least six minutes) with the example's liveness
    probe (/live on the entrypoint every 5 s, failureThreshold 3: three failed probes restart the container),
    while the other suites deploy, capture, wake and restart the controller on the node: at every look
    (5 s) kubelet reports the same container, running, never restarted, not Ready (the gate), its PID 1
    the same process, the WorkerSnapshot asleep on its capture; no liveness failure and no kill in the
    pod's Events. The API server ended every watch the worker had open when it was frozen (its audit log:
    Dynamo's watches last ``timeoutSeconds=290``), into connections frozen in the image. Then ``helm
    upgrade`` of the agent rolls its pod, and the next agent wakes the worker in place, verified by pinned
    requests, while unpinned requests served by its peer never fail; the worker watches both resources
    again within a minute of its wake (by the audit log), not after kube-client's read timeout of 295 s
    (what was measured in the sandboxes, since deleted, 275-294 s, before the agent reset a woken
    worker's connections to the API server), and the agent looked for those connections to reset
    (its log gives how many it reset: printed; node/test_agent.py's reset test proves the reset
    itself). node/test_apiserver_restart.py may restart the API server while this worker sleeps: the
    frozen watches are then ended by the server's stop, and the looks it prevented are counted apart."""
    s, w = long_sleep, long_sleep.worker
    example = next(c for c in s.graph.dgd["spec"]["components"] if c["name"] == WORKER_COMPONENT)
    main = next(c for c in example["podTemplate"]["spec"]["containers"] if c["name"] == "main")
    assert {k: main["livenessProbe"][k] for k in LIVENESS} == LIVENESS
    await s.remaining()
    await s.stop_looking()
    assert len(s.looks) >= ASLEEP_S / 5 * 0.9, f"{len(s.looks)} looks in {ASLEEP_S:.0f} s or more"
    assert not s.wrong, s.wrong[:10]
    captured = datetime.fromisoformat(s.slept["status"]["lastCapture"]["finished"])
    # node/test_apiserver_restart.py may have restarted the API server meanwhile: a server that stops
    # closes every stream it serves, and logs no end for them (auditlog.AuditLog.watches).
    assert env.cluster.cp is not None
    restarted = [down for down, _ in env.cluster.cp.apiserver_restarts if down > captured]

    async def all_ended() -> bool:
        ended = {x.audit_id: x.ended for x in s.audit.watches(w.ip)}
        return all(ended.get(x.audit_id) or restarted for x in s.frozen)
    await wait_for("the API server ending every watch the sleeping worker had open", all_ended, timeout=60,
                   interval=1)
    ended = {x.audit_id: x.ended for x in s.audit.watches(w.ip)}
    for x in s.frozen:
        end = ended[x.audit_id]
        # ended while it slept: by the server's watch timeout, or by the server's stop
        assert (end is not None and end > captured) or (end is None and restarted), (x.uri, end, captured)

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
        woken_at = datetime.now(UTC)
        await override(env, w, "active")
        woken = await wait_ws(env, w, "woken and verified", verified_after(before))
    finally:
        await load.stop()
    assert load.results and not load.failures(), load.failures()[:5]
    await proven(env, w, woken, "snapshot")
    await same_pod(env, w, s.first)

    async def watching_again() -> bool:
        return watched_since(s.audit, w, woken_at)
    await wait_for("the woken worker watching the API server again", watching_again, timeout=60, interval=1)
    agent_log = await env.pod_log(NS, new["metadata"]["name"], "agent", tail=5000)
    reset = re.findall(r"reset (\d+) connection\(s\) of the woken worker to the API server", agent_log)
    assert reset, "the next agent looked for the woken worker's connections to the API server"
    killed = [e for e in await events_for(env.api, w.namespace, w.name)
              if (e.get("regarding") or {}).get("uid") == w.uid
              and (e.get("reason") == "Killing" or "Liveness probe failed" in (e.get("note") or ""))]
    assert not killed, killed
    now_agent = await chart_pod(env, "agent")  # the node's only agent since the upgrade: the wake was its own
    assert now_agent["metadata"]["name"] == new["metadata"]["name"] and now_agent["status"]["containerStatuses"][0][
        "restartCount"] == 0, now_agent["status"]
    print(f"\nasleep {len(s.looks) * 5:.0f} s or so under /live every 5 s: {len(s.looks)} looks, the same container, "
          f"restartCount {s.first.restart_count}; woken by {new['metadata']['name']}, which reset {reset[-1]} of "
          f"its connections to the API server; its {len(s.frozen)} watches ended by the server while it slept"
          + (f" ({len(restarted)} restart(s) of it; {len(s.skipped)} look(s) not taken then)" if restarted else ""))
