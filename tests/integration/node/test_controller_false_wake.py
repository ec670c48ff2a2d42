"""A woken worker that is no longer the one the frontend knows ends ``Verified=False DwmChanged`` and is
never put back into serving, while its peer answers the unpinned traffic: the controller never takes
"the agent says Active" for proof. On the real node (kubelet, containerd, runc; dynsnap installed by
``helm install``: realnodeenv.py), each case its own graph of examples/dgd/agg.yaml under the local
overlay (moved from the sandbox suite test_controller_false_wake.py, which keeps the frozen worker).

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
"""

from __future__ import annotations

import contextlib
import time

import pytest
from controllerenv import Load, events_for, gate_of, history, one_asleep, policy, wait_verdict
from realnodeenv import WORKER_COMPONENT, Env, component_policy, deployed

from dynsnap.k8s.client import Obj
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import NodePod

pytestmark = pytest.mark.cluster

CASES = ["dwm-instance-id", "dwm-recreated", "dwm-transport"]


def graph(env: Env, name: str) -> Obj:
    """examples/dgd/agg.yaml (two workers) with the graph's policy and the component's own."""
    body = chart_node.example_body(env, name=name, policy=policy(
        enabled=True, idle_after="2s", tier="suspend", wake_at_inflight=1))
    return component_policy(body, WORKER_COMPONENT, policy(min_active=1, verify_requests=3, on_failed_wake="none"))


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
