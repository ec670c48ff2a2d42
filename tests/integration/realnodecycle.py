"""What the tests on the real node with dynsnap installed do to one worker, and the facts they read
after: the manual override (as ``dynsnap suspend|wake`` sets it), a WorkerSnapshot waited for, a
capture and a verified wake in place (``cycle``), the tier of the graph, a trickle of unpinned requests
through the frontend, and the runtime's and kubelet's own account of the container (the same one,
running, never restarted).

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime

import controllerenv
from controllerenv import Load, asleep, cond, get_ws, verified_after
from realnodeenv import Env
from realnodefacts import KubeletFacts, containerd_task, kubelet_facts, runc_state

from dynsnap.k8s.client import Obj
from dynsnap.models import resources as R
from dynsnap.models.dynamo import instance_id_from_dwm
from dynsnap.testenv.cluster import wait_for
from dynsnap.testenv.real_graph import NodePod


async def override(env: Env, w: NodePod, value: str | None) -> None:
    """``dynsnap suspend|wake POD`` (``suspended``, ``active``): the WorkerSnapshot's ``dynsnap.io/override``, as the
    CLI writes it; None takes it away."""
    await controllerenv.set_override(env.api, w, value)


async def wait_ws(env: Env, w: NodePod, what: str, check: Callable[[Obj | None], bool], timeout: float = 240) -> Obj:
    """controllerenv.wait_ws with the real node's bound: its agent and controller run from images, under kubelet."""
    return await controllerenv.wait_ws(env, w, what, check, timeout=timeout)


def seconds(record: Obj) -> float:
    return (datetime.fromisoformat(record["finished"]) - datetime.fromisoformat(record["started"])).total_seconds()


@contextlib.asynccontextmanager
async def trickle(env: Env) -> AsyncIterator[Load]:
    """Unpinned requests through the frontend all along: the peer serves them; none may fail."""
    assert env.fe is not None
    load = Load(env.fe, concurrency=1, pause=1.0, max_tokens=2)
    load.start()
    try:
        yield load
    finally:
        await load.stop()
    assert load.results and not load.failures(), load.failures()[:5]


async def ready_is(env: Env, w: NodePod, ready: bool) -> bool:
    return (await kubelet_facts(env.api, w)).ready is ready


async def cycle(env: Env, w: NodePod, tier: str, while_asleep: Callable[[Obj], Awaitable[None]], *,
                timings: list[float] | None = None) -> Obj:
    """Suspend ``w`` through the override, run ``while_asleep`` on its WorkerSnapshot, wake it; returns the
    woken WorkerSnapshot once the controller has verified this wake and the pod is Ready again."""
    before = (((await get_ws(env.api, w)) or {}).get("status") or {}).get("lastWake", {}).get("id")
    await override(env, w, "suspended")
    slept = await wait_ws(env, w, f"asleep ({tier})", asleep)
    assert slept["status"]["lastCapture"]["ok"] is True and slept["status"]["lastCapture"]["tier"] == tier
    # Out of serving only through the gate: kubelet's own readiness says so while the worker sleeps.
    await wait_for(f"{w.name} not Ready while asleep", lambda: ready_is(env, w, False), timeout=60, interval=0.5)
    await while_asleep(slept)
    await override(env, w, "active")
    woken = await wait_ws(env, w, "woken and verified", verified_after(before))
    wake = await proven(env, w, woken, tier)
    if timings is not None:
        timings.append(seconds(wake))
    return woken


async def proven(env: Env, w: NodePod, woken: Obj, tier: str) -> Obj:
    """``woken`` (its WorkerSnapshot once this wake is verified) was a ``tier`` wake proven by 3 requests
    pinned to the instance its DWM names, Verified=True, and kubelet has the pod Ready again; returns the wake."""
    wake: Obj = woken["status"]["lastWake"]
    assert wake["ok"] is True and wake["tier"] == tier, wake
    v = woken["status"]["controller"]["verification"]
    dwm = await env.api.get(R.DWMS, w.name, namespace=w.namespace)
    assert v["ok"] is True and v["answered"] == v["requests"] == 3 and v["workerId"] == instance_id_from_dwm(dwm)
    verified = cond(woken, "Verified")
    assert verified is not None and verified["status"] == "True" and verified["reason"] == "Verified"
    await wait_for(f"{w.name} Ready again", lambda: ready_is(env, w, True), timeout=60, interval=0.5)
    return wake


async def set_tier(env: Env, w: NodePod, tier: str) -> None:
    assert env.graph is not None
    await env.api.merge_patch(R.DGDS, env.graph.dgd["metadata"]["name"],
                              {"metadata": {"annotations": {"dynsnap.io/tier": tier}}},
                              namespace=env.graph.dgd["metadata"]["namespace"])
    await wait_ws(env, w, f"tier {tier}", lambda ws: bool(ws and ws["spec"]["tier"] == tier), timeout=60)


async def runtime_runs(env: Env, container_id: str, pid: int) -> None:
    """runc and containerd report the container running, with its PID 1 the same process."""
    state = await runc_state(env.node, container_id)
    assert state["id"] == container_id and state["status"] == "running" and state["pid"] == pid, state
    assert await containerd_task(env.node, container_id) == (pid, "RUNNING")


async def same_pod(env: Env, w: NodePod, first: KubeletFacts) -> None:
    now = await kubelet_facts(env.api, w)
    assert (now.uid, now.ip, now.container_id, now.restart_count, now.running) == (
        w.uid, w.ip, first.container_id, first.restart_count, True)



async def all_ready(env: Env, pods: list[NodePod]) -> bool:
    """Every one of ``pods`` Ready by kubelet's own account (its probes and the gate)."""
    for p in pods:
        live = await env.api.get(R.PODS, p.name, namespace=p.namespace)
        if not any(c["type"] == "Ready" and c["status"] == "True" for c in live["status"].get("conditions") or []):
            return False
    return True


def back_after_refusal(reason: str) -> Callable[[Obj | None], bool]:
    """Refused for good for ``reason``, on record, Active wanted, and the return (a recall) verified."""
    def check(ws: Obj | None) -> bool:
        rec = ((ws or {}).get("status") or {}).get("controller") or {}
        ref, v, q = rec.get("refusal") or {}, rec.get("verification") or {}, rec.get("quiesce") or {}
        return bool(ws and ref.get("reason") == reason and ws["spec"]["desiredState"] == "Active"
                    and v.get("ok") is True and v.get("wakeId") == f"recall-{q.get('id')}"
                    and v.get("started", "") >= q.get("started", "~"))
    return check


def state_is(state: str, *, suspended: bool | None = None) -> Callable[[Obj | None], bool]:
    """The agent reports ``state`` (and, if given, the Suspended condition True or False)."""
    def check(ws: Obj | None) -> bool:
        st = (ws or {}).get("status") or {}
        c = cond(ws, "Suspended")
        return st.get("state") == state and (suspended is None or (
            c is not None and c["status"] == ("True" if suspended else "False")))
    return check


REFUSALS = 3  # pinned(): refused requests asked again, at most


async def pinned(env: Env, w: NodePod, n: int = 2, *, prompt: str = "pinned") -> None:
    """``n`` requests pinned to ``w`` through the frontend, each answered by it. One the frontend
    refuses (an error naming no worker: it does not route to ``w`` at that moment) is printed and asked
    again once it routes there, as the controller's verification does (at most ``REFUSALS``): after a
    serving gate went False and True again within a second or two, kubelet may apply the False late and
    take the pod out of its EndpointSlice for about a second (dynsnap/controller/plan.py, SETTLE_S;
    node/test_agent_trust.py met it under load: a quiesce called off, then a 400 right after a routed
    request). An answer by another worker fails at once: a pinned request never falls back."""
    assert env.fe is not None
    iid = instance_id_from_dwm(await env.api.get(R.DWMS, w.name, namespace=w.namespace))
    await env.fe.wait_routable(iid, timeout=120)
    refused: list[str] = []
    i = 0
    while i < n:
        res = await env.fe.chat(f"{prompt} {i}", worker_id=iid, max_tokens=2)
        if res.status != 200 and res.worker_id is None and len(refused) < REFUSALS:
            refused.append(f"HTTP {res.status} {res.body}")
            print(f"{w.name}: a pinned request refused ({refused[-1]}); asked again once it routes there")
            await env.fe.wait_routable(iid, timeout=120)
            continue
        assert res.status == 200 and res.worker_id == iid, (res.body, refused)
        i += 1
