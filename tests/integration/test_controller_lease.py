"""Leader election with the real controller: of two replicas one acts; when its Lease is taken
from it in the middle of a wake it stops acting at once and exits non-zero (its Deployment would
restart it), nobody finishes the wake while someone else holds the Lease, and the other replica,
once it leads, carries the wake through to a verification of its own. Both run under the shipped
RBAC (leases only in their own namespace)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from controllerenv import asleep, events_for, get_ws, policy, running, verified_after, wait_ws

from dynsnap.k8s.client import Kube, Obj
from dynsnap.k8s.errors import Conflict
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.testenv import dynamo as D
from dynsnap.testenv.cluster import LocalCluster, wait_for
from dynsnap.testenv.dynsnap_parts import AGENT_NS, ControllerProc, StubDriver

pytestmark = pytest.mark.cluster

LEASE = ["--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5"]


def make(driver: StubDriver) -> Obj:
    worker = D.mocker_component("worker", replicas=2, dynsnap=True, env={"LD_PRELOAD": str(driver.libcuda)})
    worker["annotations"] = policy(enabled=True, idle_after="2s", tier="suspend", min_active=1)
    return D.dgd("lease", [D.frontend_component(), worker])


async def _holder(api: Kube) -> str | None:
    lease = await api.get(R.LEASES, "dynsnap-controller", namespace=AGENT_NS)
    return str(lease["spec"].get("holderIdentity") or "") or None


async def test_lease_lost_mid_wake_stops_the_leader_and_the_other_replica_verifies(cluster: LocalCluster) -> None:
    async with running(cluster, make, controller_args=LEASE) as env:
        api = env.api
        leader = env.controller
        assert await wait_for("controller-0 leads", lambda: _is(api, "controller-0"), timeout=30)
        follower = ControllerProc(env.ctl_kubeconfig, env.work / "controller-1", identity="controller-1",
                                  extra=["--verify-timeout", "30", *LEASE])
        await follower.start()
        try:
            workers = env.graph.workers("worker")

            async def one_asleep() -> Obj | None:
                for p in workers:
                    ws = await get_ws(api, p)
                    if asleep(ws):
                        return {"pod": p, "ws": ws}
                return None
            found = await wait_for("one worker asleep", one_asleep, timeout=120, interval=0.5)
            pod, ws = found["pod"], found["ws"]
            since = (ws["status"].get("lastWake") or {}).get("id")
            # The agent's resume will take a few seconds: the wake is mid-way when the Lease goes.
            env.driver.control("hang cuCheckpointProcessUnlock * 4000")
            await api.merge_patch(R.PODS, pod.name, {"metadata": {"annotations": {P.ANN_DESIRED_STATE: "active"}}},
                                  namespace=pod.namespace)
            await wait_ws(env, pod, "wake requested", lambda w: bool(w and w["spec"]["desiredState"] == "Active"),
                          timeout=60)
            # Someone else takes the Lease (as a partitioned-then-returned replica's successor would).
            await _take_lease(api, "intruder")
            assert leader.proc is not None and leader.proc.proc is not None
            rc = await asyncio.wait_for(leader.proc.proc.wait(), 30)
            assert rc == 1, leader.tail(40)
            assert "lease" in leader.tail(40) and "intruder" in leader.tail(40)
            # The agent finishes its part; with the Lease held by nobody of ours, nobody verifies.
            await wait_ws(env, pod, "agent woke it", lambda w: bool(w and (w.get("status") or {}).get("state") ==
                                                                    "Active" and (w["status"].get("lastWake") or
                                                                                  {}).get("finished")), timeout=60)
            ws = await get_ws(api, pod)
            v = ((ws or {}).get("status") or {}).get("controller", {}).get("verification") or {}
            assert not verified_after(since)(ws) and v.get("ok") is not True
            # The Lease comes free: the other replica leads and proves the wake.
            env.driver.clear_faults()
            await api.delete(R.LEASES, "dynsnap-controller", namespace=AGENT_NS)
            assert await wait_for("controller-1 leads", lambda: _is(api, "controller-1"), timeout=30)
            ws = await wait_ws(env, pod, "verified by the new leader", verified_after(since), timeout=90)
            assert ws["status"]["controller"]["verification"]["answered"] == 3
            async def verified_events() -> list[Obj] | None:
                # The Event follows the status write that records the verdict: wait for it.
                evs = [e for e in await events_for(api, pod.namespace, pod.name) if e["reason"] == "Verified"]
                return evs or None
            evs = await wait_for("the Verified Event", verified_events, timeout=30)
            assert {e["reportingInstance"] for e in evs} == {"controller-1"}, evs
        finally:
            await follower.stop()


async def _is(api: Kube, who: str) -> bool:
    try:
        return await _holder(api) == who
    except Exception:
        return False


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def _take_lease(api: Kube, who: str, attempts: int = 10) -> None:
    """Write ``who`` as the Lease's holder for an hour. The leader renews between our read and our
    write now and then (409 Conflict): read again and retry, a bounded number of times."""
    for attempt in range(attempts):
        lease = await api.get(R.LEASES, "dynsnap-controller", namespace=AGENT_NS)
        lease["spec"].update({"holderIdentity": who, "renewTime": _now(), "acquireTime": _now(),
                              "leaseDurationSeconds": 3600})
        try:
            await api.replace(R.LEASES, lease)
            return
        except Conflict:
            if attempt == attempts - 1:
                raise
