"""A woken worker that is no longer the one the frontend knows ends ``Verified=False DwmChanged`` and is
never put back into serving, and one that cannot answer ends ``Verified=False PinnedRequestFailed``,
while its peer answers the unpinned traffic: the controller never takes "the agent says Active" (nor an
answer through the frontend) for proof. On the real node (kubelet, containerd, runc; dynsnap installed by
``helm install``: realnodeenv.py), each case its own graph of examples/dgd/agg.yaml under the local
overlay (moved from the sandbox suite test_controller_false_wake.py, now gone).

Two workers, ``min-active: 1``, tier suspend, ``on-failed-wake: none``: idleness puts one to sleep;
while it sleeps its DWM (the record Dynamo's frontend routes by, which the worker wrote itself) is
changed as an admin would, so the frontend's idea of the worker no longer leads to it:

- ``dwm-instance-id``: the generate endpoint's instance id made the peer's;
- ``dwm-recreated``: the DWM deleted and created again (a new UID);
- ``dwm-transport``: the endpoint's transport pointed at the peer (same UID, same instance id: pinned
  answers would all come back naming this worker, served by the peer).

Then load through the frontend wakes it. The agent wakes it in place (its own account: Active, the
wake ok); the controller compares the pod and its DWM with what they were at the capture, fails the
wake ``DwmChanged`` naming what changed, before a single pinned request, and leaves the pod to be
inspected: its serving gate False throughout (kubelet never counts it Ready, so no request is ever
routed to it), a Warning Event, and every unpinned request answered by the peer.

The frozen worker (moved from the sandbox suite, which is gone): the same graph with
``on-failed-wake`` ``none`` or ``restart``; one worker captured (tier suspend: its processes stay),
and before load wakes it its worker tree is stopped (SIGSTOP), the entrypoint (the container's PID 1)
left running, so it cannot answer. The agent still wakes it (the driver state and the entrypoint do not
need the worker to run) and only the pinned requests show it: each gets the frontend's 504 ->
``Verified=False PinnedRequestFailed``, a Warning Event, the gate False again. With ``none`` the pod is
left to be inspected; with ``restart`` it is deleted (``ColdRestart``), and the delete carries the
pod's UID as a precondition: held at the API server's door (the chart's controller reaches the API
server through fake_apiproxy, ``helm upgrade``) while the test replaces the pod under the same name,
it deletes nothing. The example's probes ask the entrypoint, which answers 503 for a frozen worker:
kubelet would take it out of Ready within 30 s and restart it within 5 s (liveness every 5 s,
failureThreshold 1; seen on this node), before a pinned request could show it. So these graphs widen
both windows (readiness 60 x 10 s, liveness 120 x 5 s), the probe settings of a user whose kubelet
keeps a hung worker for minutes: the case the controller must catch by itself.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator

import pytest
from controllerenv import Load, cond, events_for, gate_of, history, one_asleep, policy, wait_verdict
from realnodeenv import WORKER_COMPONENT, Env, component_policy, controller_through_proxy, deployed, worker_main
from realnodefacts import container_procs, kubelet_facts, stopped

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.fake_apiproxy import FakeApiProxy, Fault
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

CASES = ["dwm-instance-id", "dwm-recreated", "dwm-transport"]


VERIFY_TIMEOUT = 8  # seconds from the wake to a verdict: one round of pinned requests (504 after 5 s)
READY_WINDOW = 60  # the frozen cases' readiness failureThreshold (x periodSeconds 10): ten minutes
LIVE_WINDOW = 120  # and liveness failureThreshold (x periodSeconds 5): ten minutes


def graph(env: Env, name: str, on_failed_wake: str = "none") -> Obj:
    """examples/dgd/agg.yaml (two workers) with the graph's policy and the component's own."""
    body = chart_node.example_body(env, name=name, policy=policy(
        enabled=True, idle_after="2s", tier="suspend", wake_at_inflight=1))
    return component_policy(body, WORKER_COMPONENT, policy(min_active=1, verify_requests=3,
                                                           on_failed_wake=on_failed_wake))


async def generate_key(env: Env, pod: NodePod) -> tuple[Obj, str]:
    dwm = await env.api.get(R.DWMS, pod.name, namespace=pod.namespace)
    key = next(k for k, e in dwm["spec"]["data"]["endpoints"].items() if e.get("endpoint") == "generate")
    return dwm, key


async def change_dwm(env: Env, how: str, pod: NodePod, peer: NodePod) -> str:
    """Make the sleeping worker's DWM lead elsewhere (as admin: nothing in the product may do this).
    Returns the text the controller's reason must name."""
    dwm, key = await generate_key(env, pod)
    peer_dwm, peer_key = await generate_key(env, peer)
    if how == "dwm-instance-id":
        peer_id = peer_dwm["spec"]["data"]["endpoints"][peer_key]["instance_id"]
        await env.api.merge_patch(R.DWMS, pod.name, {"spec": {"data": {"endpoints": {key: {"instance_id": peer_id}}}}},
                                  namespace=pod.namespace)
        return f"instance id {peer_id}, was {instance_id_from_dwm(dwm)}"
    if how == "dwm-recreated":
        await env.api.delete(R.DWMS, pod.name, namespace=pod.namespace, uid=dwm["metadata"]["uid"])
        meta = dwm["metadata"]
        again = {"apiVersion": dwm["apiVersion"], "kind": dwm["kind"], "spec": dwm["spec"],
                 "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": meta.get("labels") or {},
                              "ownerReferences": meta["ownerReferences"]}}
        created = await env.api.create(R.DWMS, again)
        assert created["metadata"]["uid"] != meta["uid"]
        return f"DWM UID {created['metadata']['uid']}, was {meta['uid']}"
    assert how == "dwm-transport"
    peer_tcp = str(peer_dwm["spec"]["data"]["endpoints"][peer_key]["transport"]["tcp"])
    patch = {"spec": {"data": {"endpoints": {key: {"transport": {"tcp": peer_tcp}}}}}}
    await env.api.merge_patch(R.DWMS, pod.name, patch, namespace=pod.namespace)
    return peer_tcp


@pytest.mark.parametrize("case", CASES)
async def test_a_woken_worker_whose_dwm_changed_is_not_verified_nor_served_while_the_peer_serves(
        env: Env, case: str) -> None:
    async with deployed(env, graph(env, f"false-{case}")) as g:
        assert env.fe is not None  # the graph's frontend (deployed)
        pod, peer = await one_asleep(env.api, g.workers(WORKER_COMPONENT))
        peer_id = instance_id_from_dwm(await env.api.get(R.DWMS, peer.name, namespace=peer.namespace))
        async with contextlib.AsyncExitStack() as stack:
            pods = await stack.enter_async_context(history(env.api, R.PODS, pod))
            wss = await stack.enter_async_context(history(env.api, R.WORKER_SNAPSHOTS, pod))
            names = await change_dwm(env, case, pod, peer)
            load = Load(env.fe, concurrency=4, max_tokens=30)  # demand over one worker's share: wakes the sleeper
            load.start()
            try:
                ws = await wait_verdict(wss, "DwmChanged")
                decided = time.time()

                async def after_verdict() -> bool:  # unpinned answers after the verdict, to look at below
                    return sum(1 for r in load.results if r[0] > decided + 5) >= 4
                await wait_for("unpinned answers after the verdict", after_verdict, timeout=60)
            finally:
                await load.stop()

        v = ws["status"]["controller"]["verification"]
        assert v["ok"] is False and v["reason"] == "DwmChanged" and v["fallback"] == "none", v
        assert names in v["message"], (names, v["message"])
        assert v.get("requests") in (None, 0), v  # refused before any pinned request was sent to it
        # The agent did wake it, in place: the failure is the controller's finding, not the agent's.
        assert ws["status"]["state"] == "Active" and ws["status"]["lastWake"]["ok"] is True, ws["status"]

        events = await events_for(env.api, pod.namespace, pod.name)
        warned = [e for e in events if e["type"] == "Warning" and e["reason"] == "DwmChanged"]
        assert warned and "fallback: none" in warned[-1]["note"], events

        # Never back into serving: the gate False in every version of the pod since it slept, and kubelet
        # never counted it Ready; the pod left to be inspected (the same UID, its container never restarted).
        gate = [gate_of(p) for p in pods if p["metadata"]["uid"] == pod.uid]
        assert set(gate) == {"False"}, f"put back into serving although its DWM changed: {gate}"
        ready = [c["status"] for p in pods for c in (p.get("status") or {}).get("conditions") or []
                 if c["type"] == "Ready"]
        assert "True" not in ready, ready
        live = await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
        assert live["metadata"]["uid"] == pod.uid and not live["metadata"].get("deletionTimestamp")
        assert gate_of(live) == "False"
        assert {c.get("restartCount") for c in live["status"]["containerStatuses"]} == {0}, live["status"]
        assert not [e for e in events if e["reason"] == "ColdRestart"]

        # The peer answered the unpinned traffic throughout, none failed: nothing was routed to the
        # woken worker.
        answered = [r for r in load.results if r[1] == 200]
        assert len(answered) >= 4 and {r[2] for r in answered} == {peer_id}, {r[2] for r in answered}
        assert not load.failures(), load.failures()[:5]


# -- the frozen worker -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def proxy(env: Env) -> AsyncIterator[FakeApiProxy]:
    """The chart's controller through fake_apiproxy with a short verification bound, for the frozen
    cases (after the DWM cases: a module fixture first asked for by the last test); the install as it
    was after."""
    async with controller_through_proxy(env, verifyTimeout=VERIFY_TIMEOUT) as p:
        yield p


def worker_pids(pod: NodePod, container_id: str) -> list[int]:
    """Host pids of every process of the worker container but its entrypoint (PID 1)."""
    return list(container_procs(pod.uid, container_id).tree)


async def replace_pod(env: Env, pod: NodePod) -> str:
    """The pod gone and another in its place under the same name (the operator's replacement, as the
    API server sees it: a new UID; its image is never pulled, nothing of it runs). Returns the new UID."""
    await env.api.delete(R.PODS, pod.name, namespace=pod.namespace, grace_period_seconds=0)

    async def gone() -> bool:
        return await live_pod(env, pod) is None
    await wait_for(f"{pod.name} gone", gone, timeout=60)
    created = await env.api.create(R.PODS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod.name, "namespace": pod.namespace},
        "spec": {"nodeName": env.node.name, "terminationGracePeriodSeconds": 0, "containers": [
            {"name": "main", "image": "dynsnap.local/replacement:0", "imagePullPolicy": "Never"}]}})
    return str(created["metadata"]["uid"])


async def live_pod(env: Env, pod: NodePod) -> Obj | None:
    with contextlib.suppress(NotFound):
        return await env.api.get(R.PODS, pod.name, namespace=pod.namespace)
    return None


FROZEN = [("frozen", "none"), ("frozen", "restart"), ("frozen-replaced", "restart")]


@pytest.mark.parametrize(("case", "on_failed_wake"), FROZEN, ids=[f"{c}-{f}" for c, f in FROZEN])
async def test_a_wake_that_does_not_serve_is_not_verified_while_the_peer_serves(
        env: Env, proxy: FakeApiProxy, case: str, on_failed_wake: str) -> None:
    body = graph(env, f"false-{case}-{on_failed_wake}", on_failed_wake)
    main = worker_main(body)
    main["readinessProbe"]["failureThreshold"] = READY_WINDOW
    main["livenessProbe"]["failureThreshold"] = LIVE_WINDOW
    replacement = None
    async with deployed(env, body) as g:
        assert env.fe is not None
        pod, peer = await one_asleep(env.api, g.workers(WORKER_COMPONENT))
        peer_id = instance_id_from_dwm(await env.api.get(R.DWMS, peer.name, namespace=peer.namespace))
        first = await kubelet_facts(env.api, pod)
        reason = "PinnedRequestFailed"
        try:
            async with contextlib.AsyncExitStack() as stack:
                pods = await stack.enter_async_context(history(env.api, R.PODS, pod))
                wss = await stack.enter_async_context(history(env.api, R.WORKER_SNAPSHOTS, pod))
                stack.enter_context(stopped(worker_pids(pod, first.container_id)))
                if case == "frozen-replaced":
                    # The controller's fallback delete is held at the API server's door until the pod is replaced.
                    proxy.add(Fault("stall", method="DELETE",
                                    path_contains=f"/namespaces/{pod.namespace}/pods/{pod.name}"))
                load = Load(env.fe, concurrency=4, max_tokens=30)  # demand over one worker's share: wakes it
                load.start()
                try:
                    ws = await wait_verdict(wss, reason)
                    decided = time.time()
                    if case == "frozen-replaced":
                        await proxy.wait_stalled(1, timeout=60)
                        replacement = await replace_pod(env, pod)
                        proxy.release()
                    if on_failed_wake == "restart":
                        async def restarted() -> bool:
                            return "ColdRestart" in {e["reason"] for e in await events_for(
                                env.api, pod.namespace, pod.name)}
                        await wait_for("the ColdRestart Event (after the fallback's delete returned)", restarted,
                                       timeout=60)

                    async def after_verdict() -> bool:  # unpinned answers after the verdict, to look at below
                        return sum(1 for r in load.results if r[0] > decided + 7) >= 4
                    await wait_for("unpinned answers after the verdict", after_verdict, timeout=60)
                finally:
                    await load.stop()
            live = await live_pod(env, pod)
            events = await events_for(env.api, pod.namespace, pod.name)
        finally:
            proxy.release()
            if replacement is not None:  # not the graph's: the graph's teardown leaves it
                with contextlib.suppress(NotFound):
                    await env.api.delete(R.PODS, pod.name, namespace=pod.namespace, grace_period_seconds=0)

    v = ws["status"]["controller"]["verification"]
    assert v["ok"] is False and v["reason"] == reason, v
    verified = cond(ws, "Verified")
    assert verified is not None and verified["status"] == "False" and verified["reason"] == reason
    # The agent did wake it: the failure is the controller's finding, not the agent's.
    assert ws["status"]["state"] == "Active" and ws["status"]["lastWake"]["ok"] is True
    # Pinned requests were sent and none was answered: the frontend's deadline for a frozen worker
    # (504 after 5 s), or its 500 once a request to the instance has failed that way.
    assert v["answered"] == 0 and v["requests"] >= 1, v
    assert v["headers"] == [P.HEADER_WORKER_INSTANCE_ID], v
    assert "0/3 pinned requests answered" in v["message"], v["message"]
    assert re.search(r"; last: HTTP 50[04]: ", v["message"]), v["message"]
    warned = [e for e in events if e["type"] == "Warning" and e["reason"] == reason]
    assert warned and f"fallback: {v['fallback']}" in warned[-1]["note"], events

    gate: list[str | None] = []  # the values the failed pod's gate took, in order
    for version in pods:
        if version["metadata"]["uid"] == pod.uid and (not gate or gate_of(version) != gate[-1]):
            gate.append(gate_of(version))
    # Back into serving for the pinned requests (the frontend routes only to a ready endpoint), then out.
    assert gate[0] == "False" and "True" in gate and gate[-1] == "False", gate
    if on_failed_wake == "none":
        assert v["fallback"] == "none"
        assert live is not None and live["metadata"]["uid"] == pod.uid, "the pod is left to be inspected"
        assert gate_of(live) == "False", "taken out of serving again"
        # kubelet kept the container: the same one, never restarted (the widened windows).
        assert {(c["containerID"].split("//")[-1], c["restartCount"]) for c in live["status"]["containerStatuses"]
                if c["name"] == "main"} == {(first.container_id, 0)}, live["status"]
        assert not [e for e in events if e["reason"] == "ColdRestart"]
    else:
        assert v["fallback"] == "ColdRestart"
        assert [e for e in events if e["type"] == "Warning" and e["reason"] == "ColdRestart"], events
        if case == "frozen-replaced":
            # The delete named the failed pod's UID: the pod now under that name survived it.
            assert proxy.seen(method="DELETE", path_contains=f"/pods/{pod.name}")
            assert live is not None and live["metadata"]["uid"] == replacement, live
            assert not live["metadata"].get("deletionTimestamp"), live["metadata"]
        else:
            assert live is None or live["metadata"].get("deletionTimestamp") or \
                live["metadata"]["uid"] != pod.uid, "the failed pod was deleted"

    # The peer answered the unpinned traffic throughout; the failed worker answered none of it.
    answered = [r for r in load.results if r[1] == 200]
    assert len(answered) >= 4 and {r[2] for r in answered} == {peer_id}, {r[2] for r in answered}
    # What the frontend routed to the frozen worker between its gate going True and the verdict (plus
    # the frontend's lag in seeing its endpoint go) failed: the frontend's deadline (504), its 500 for an
    # instance a request already failed on, or 503 when the pod was deleted under the request. None later.
    failed = load.failures()
    assert all(r[1] in (500, 503, 504) for r in failed), failed[:5]
    assert not [r for r in failed if r[0] > decided + 7], failed[:5]
