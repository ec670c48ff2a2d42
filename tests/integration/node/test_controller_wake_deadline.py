"""A wake that never reaches Active is a failed wake (issue 18), and the planner makes up for it.
On the real node (kubelet, containerd, runc; dynsnap installed by ``helm install`` with
``controller.wakeTimeout`` 60 s: realnodeenv.SHARED_VALUES), each case its own graph of examples/dgd/agg.yaml.

Three workers of one component (tier snapshot, min-active 1): idleness puts two to sleep, their
trees dumped by the real CRIU inside their containers. The image of the one captured last (the one a
deficit wakes first) is then damaged on the node, for real, and the component's min-active raised
to 2, so the controller wakes it:

- ``corrupted`` (``pstree.img`` overwritten with garbage): every CRIU restore fails
  (``CriuRestoreFailed``) and the agent retries with backoff; the worker stays Waking. Past
  ``--wake-timeout`` the controller calls it a failed wake;
- ``deleted`` (the capture's directory removed): the agent finds nothing to restore and gives the
  worker up (``WorkerLost``, state Lost); the controller calls the wake failed at once.

Either way: ``Verified=False`` ``WakeFailed`` with the agent's reason in its message, a Warning Event,
``status.controller.verification`` failed for that wake with the policy's fallback (``restart``: the
pod deleted with its UID as precondition; ``none``: left out of serving, its gate False), and the
other sleeping worker woken in its place, verified. With ``none`` (the deleted capture) the agent's
give-up makes the entrypoint exit and kubelet starts the container cold in the same pod (restartCount
1), which the gate keeps out of serving. Before issue 18 the
corrupted worker counted as awake while it kept failing (nothing woken in its place, no verdict), and
the lost one got no verdict.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
from controllerenv import asleep, cond, events_for, gate_of, get_ws, history, policy, wait_ws
from realnodeenv import SHARED_VALUES, WORKER_COMPONENT, Env, component_policy, deployed, edit_dgd

from dynsnap.k8s.client import Obj
from dynsnap.k8s.errors import NotFound
from dynsnap.models import protocol as P
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv import chart_node
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import Graph, NodePod, kubelet_facts

pytestmark = pytest.mark.cluster

WAKE_TIMEOUT = SHARED_VALUES["controller"]["wakeTimeout"]  # seconds from the wake request to Active, verified



def graph(env: Env, name: str, on_failed_wake: str) -> Obj:
    """examples/dgd/agg.yaml with three workers, the graph's policy and the component's own (on its pod
    template)."""
    body = chart_node.example_body(env, name=name, worker_replicas=3, policy=policy(
        enabled=True, idle_after="2s", tier="snapshot", wake_at_inflight=1))
    return component_policy(body, WORKER_COMPONENT, policy(min_active=1, verify_requests=2,
                                                           on_failed_wake=on_failed_wake))


def capture_dir(env: Env, pod: NodePod) -> Path:
    """The worker's one finished capture on the node (the agent's images root, the chart's host path)."""
    pod_dir = env.paths.images / f"{pod.namespace}_{pod.name}_{pod.uid}"
    captures = [d for d in pod_dir.iterdir() if d.is_dir() and not d.name.startswith(P.STAGING_PREFIX)]
    assert len(captures) == 1, captures
    return captures[0]


def damage(env: Env, pod: NodePod, how: str) -> None:
    d = capture_dir(env, pod)
    if how == "deleted":
        shutil.rmtree(d)
        return
    pstree = d / "pstree.img"
    assert pstree.is_file(), list(d.iterdir())
    pstree.write_bytes(b"\xde\xad" * 64)


async def set_min_active(env: Env, g: Graph, n: int) -> None:
    """What a user's `kubectl edit` of the DGD does: the worker component's min-active changed."""
    await edit_dgd(env, g, lambda obj: component_policy(obj, WORKER_COMPONENT, {P.ANN_MIN_ACTIVE: str(n)}))


def wake_failed(ws: Obj | None) -> bool:
    v = ((ws or {}).get("status") or {}).get("controller", {}).get("verification") or {}
    c = cond(ws, "Verified")
    return bool(v.get("ok") is False and v.get("reason") == "WakeFailed" and c and c["status"] == "False"
                and c["reason"] == "WakeFailed")


def verified_wake(ws: Obj | None) -> bool:
    st = (ws or {}).get("status") or {}
    v = (st.get("controller") or {}).get("verification") or {}
    return bool(ws and ws["spec"]["desiredState"] == "Active" and st.get("state") == "Active" and v.get("ok") is True
                and st.get("lastWake") and v.get("wakeId") == st["lastWake"].get("id"))


CASES = [("corrupted", "restart"), ("deleted", "none")]


@pytest.mark.parametrize(("how", "on_failed_wake"), CASES, ids=[f"{h}-{f}" for h, f in CASES])
async def test_a_wake_that_never_reaches_active_fails_and_another_worker_is_woken_in_its_place(
        env: Env, how: str, on_failed_wake: str) -> None:
    async with deployed(env, graph(env, f"wake-{how}", on_failed_wake)) as g:
        workers = g.workers(WORKER_COMPONENT)
        first = {p.name: await kubelet_facts(env.api, p) for p in workers}

        async def two_asleep() -> list[tuple[str, NodePod]] | None:
            got = [(ws, p) for p in workers if asleep(ws := await get_ws(env.api, p))]
            return [(w["status"]["lastCapture"]["started"], p) for w, p in got] if len(got) == 2 else None
        sleeping = sorted(await wait_for("two of three workers asleep", two_asleep, timeout=180, interval=0.5),
                          key=lambda t: t[0], reverse=True)
        failing, spare = sleeping[0][1], sleeping[1][1]  # a deficit wakes the most recently captured first
        damage(env, failing, how)
        # Every version of its WorkerSnapshot: the restart fallback deletes the pod, and the garbage
        # collector the WorkerSnapshot with it, right after the verdict.
        async with history(env.api, R.WORKER_SNAPSHOTS, failing) as versions:
            await set_min_active(env, g, 2)

            async def verdict() -> Obj | None:
                return next((v for v in versions if wake_failed(v)), None)
            ws = await wait_for(f"{failing.name}: its wake failed", verdict, timeout=WAKE_TIMEOUT + 120, interval=0.2)
        v = ws["status"]["controller"]["verification"]
        wake = ws["status"]["controller"]["wake"]
        assert wake["ok"] is False and wake.get("finished"), wake
        if how == "corrupted":
            assert f"not Active and verified within {WAKE_TIMEOUT}s" in v["message"], v["message"]
            assert "CriuRestoreFailed" in v["message"], v["message"]
        else:
            assert "the agent gave up on the wake: WorkerLost" in v["message"], v["message"]
        async def warned() -> list[Obj] | None:  # the Event may follow the status write it tells of
            got = [e for e in await events_for(env.api, failing.namespace, failing.name)
                   if e["type"] == "Warning" and e["reason"] == "WakeFailed"]
            return got or None
        events = await wait_for(f"{failing.name}: a WakeFailed Event", warned, timeout=30, interval=0.5)
        assert f"fallback: {v['fallback']}" in events[-1]["note"], events

        # Another sleeping worker woken in its place, and proven.
        await wait_ws(env, spare, "woken in its place, verified", verified_wake, timeout=120)
        wid = instance_id_from_dwm(await env.api.get(R.DWMS, spare.name, namespace=spare.namespace))
        assert env.fe is not None
        answer = await env.fe.chat("in its place", worker_id=wid, max_tokens=2)
        assert answer.status == 200 and answer.worker_id == wid, answer.body

        # The policy's fallback.
        live = None
        with contextlib.suppress(NotFound):
            live = await env.api.get(R.PODS, failing.name, namespace=failing.namespace)
        if on_failed_wake == "restart":
            assert v["fallback"] == "ColdRestart"
            assert live is None or live["metadata"]["uid"] != failing.uid or live["metadata"].get("deletionTimestamp")
        else:
            assert v["fallback"] == "none"
            assert live is not None and live["metadata"]["uid"] == failing.uid, "left in place to be looked at"
            assert gate_of(live) == "False", "out of serving"
            # Its tree gone, the agent's give-up makes the entrypoint exit, and kubelet starts the container
            # cold in the same pod (wake_steps.give_up): a new container, restartCount 1, still out of serving.
            async def restarted_cold() -> bool:
                now = await kubelet_facts(env.api, failing)
                return now.restart_count == 1 and now.running and now.container_id != first[failing.name].container_id
            await wait_for(f"{failing.name}: its container started cold by kubelet", restarted_cold, timeout=120,
                           interval=0.5)
            now = await kubelet_facts(env.api, failing)
            live = await env.api.get(R.PODS, failing.name, namespace=failing.namespace)
            assert now.uid == failing.uid and gate_of(live) == "False" and not now.ready, (now, live["status"])
