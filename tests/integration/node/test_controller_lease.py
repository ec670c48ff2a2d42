"""Leader election on the real node, the chart as it ships (one replica; the Lease
``<release>-controller`` in the release's namespace, held under the pod's name, under the shipped
RBAC): when the Lease is taken from the leader in the middle of a wake, it stops acting at once and
exits non-zero, and kubelet restarts its container in the same pod; while someone else holds the
Lease nobody verifies the wake (the agent finishes its part alone), and once the Lease comes free the
restarted process leads and carries the wake to a verification of its own, begun after its restart."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from controllerenv import asleep, events_for, get_ws, policy, set_override, verified_after, wait_ws
from realnodeenv import NS, RELEASE, WORKER_COMPONENT, Env, component_policy, deployed

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Conflict
from dynsnap.models import resources as R
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for

pytestmark = pytest.mark.cluster

LEASE = f"{RELEASE}-controller"  # the chart's "<fullname>-controller"
HANG_MS = 12000  # the resume held this long: several of the leader's retry periods (2 s)


def graph(env: Env) -> Obj:
    body = chart_node.example_body(env, name="lease", worker_replicas=2, speedup_ratio=1, policy=policy(
        enabled=True, idle_after="2s", tier="suspend"))
    return component_policy(body, WORKER_COMPONENT, policy(min_active=1))


async def _holder(api: Kube) -> str | None:
    try:
        lease = await api.get(R.LEASES, LEASE, namespace=NS)
    except Exception:
        return None
    return str(lease["spec"].get("holderIdentity") or "") or None


def _ctl_container(pod: Obj) -> Obj:
    return next(c for c in pod["status"].get("containerStatuses") or [] if c["name"] == "controller")


async def test_lease_lost_mid_wake_the_leader_exits_and_after_its_restart_verifies(env: Env) -> None:
    api = env.api
    (ctl,) = await env.chart_pods("controller")
    name, uid = ctl["metadata"]["name"], ctl["metadata"]["uid"]
    restarts = int(_ctl_container(ctl)["restartCount"])
    assert await wait_for("the controller pod leads", lambda: _is(api, name), timeout=30)
    async with deployed(env, graph(env)) as g:
        async def one_asleep() -> Obj | None:
            for p in g.workers(WORKER_COMPONENT):
                ws = await get_ws(api, p)
                if asleep(ws):
                    return {"pod": p, "ws": ws}
            return None
        found = await wait_for("one worker asleep", one_asleep, timeout=120, interval=0.5)
        pod, ws = found["pod"], found["ws"]
        since = (ws["status"].get("lastWake") or {}).get("id")
        # The driver holds the resume's unlock: the wake is mid-way when the Lease goes.
        env.driver.control(f"hang cuCheckpointProcessUnlock * {HANG_MS}")
        try:
            await set_override(api, pod, "active")
            await wait_ws(env, pod, "wake requested", lambda w: bool(w and w["spec"]["desiredState"] == "Active"),
                          timeout=60)
            # Someone else takes the Lease (as a partitioned-then-returned replica's successor would).
            await _take_lease(api, "intruder")

            async def exited() -> Obj | None:
                live = await api.get(R.PODS, name, namespace=NS)
                c = _ctl_container(live)
                return live if int(c["restartCount"]) > restarts else None
            live = await wait_for("the leader's container exited and restarted by kubelet", exited, timeout=90)
            c = _ctl_container(live)
            assert live["metadata"]["uid"] == uid  # the same pod: kubelet restarted its container
            assert c["lastState"]["terminated"]["exitCode"] == 1, c
            said = await env.pod_log(NS, name, "controller", tail=40, previous=True)
            assert "lease" in said.lower() and "intruder" in said, said
            # The agent finishes its part; with the Lease held by nobody of ours, nobody verifies.
            await wait_ws(env, pod, "agent woke it", lambda w: bool(w and (w.get("status") or {}).get("state") ==
                                                                    "Active" and (w["status"].get("lastWake") or
                                                                                  {}).get("finished")), timeout=60)
        finally:
            env.driver.clear_faults()
        ws = await get_ws(api, pod)
        v = ((ws or {}).get("status") or {}).get("controller", {}).get("verification") or {}
        assert not verified_after(since)(ws) and v.get("ok") is not True, v
        assert await _holder(api) == "intruder"
        # The Lease comes free: the restarted process leads and proves the wake.
        await api.delete(R.LEASES, LEASE, namespace=NS)
        assert await wait_for("the restarted controller leads", lambda: _is(api, name), timeout=30)
        ws = await wait_ws(env, pod, "verified by the restarted leader", verified_after(since), timeout=90)
        v = ws["status"]["controller"]["verification"]
        assert v["answered"] == 3, v
        live = await api.get(R.PODS, name, namespace=NS)
        started = _ctl_container(live)["state"]["running"]["startedAt"]
        assert _at(v["started"]) >= _at(started), (v["started"], started)

        async def verified_events() -> list[Obj] | None:
            # The Event follows the status write that records the verdict: wait for it.
            evs = [e for e in await events_for(api, pod.namespace, pod.name) if e["reason"] == "Verified"]
            return evs or None
        evs = await wait_for("the Verified Event", verified_events, timeout=30)
        assert {e["reportingInstance"] for e in evs} == {name}, evs
    # The package's later tests find their leader Ready again.
    await wait_for("the controller pod Ready again", lambda: _pod_ready(api, name), timeout=60)


async def _is(api: Kube, who: str) -> bool:
    return await _holder(api) == who


async def _pod_ready(api: Kube, name: str) -> bool:
    return chart_node.pod_ready(await api.get(R.PODS, name, namespace=NS))


def _at(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def _take_lease(api: Kube, who: str, attempts: int = 10) -> None:
    """Write ``who`` as the Lease's holder for an hour. The leader renews between our read and our
    write now and then (409 Conflict): read again and retry, a bounded number of times."""
    for attempt in range(attempts):
        lease = await api.get(R.LEASES, LEASE, namespace=NS)
        lease["spec"].update({"holderIdentity": who, "renewTime": _now(), "acquireTime": _now(),
                              "leaseDurationSeconds": 3600})
        try:
            await api.replace(R.LEASES, lease)
            return
        except Conflict:
            if attempt == attempts - 1:
                raise
